"""Weight dtype selection: ``auto`` is bf16 only for a frozen base on hardware with fast bf16."""

import pytest
import torch

from lightning_memrl import distributed, models
from lightning_memrl.models import LoraSettings, build_tiny_tokenizer, load_policy, resolve_dtype


def test_named_dtypes_pass_through() -> None:
    assert resolve_dtype("float32", frozen_base=True) is torch.float32
    assert resolve_dtype("bfloat16", frozen_base=False) is torch.bfloat16


def test_auto_is_fp32_for_full_fine_tuning_even_with_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "fast_bf16", lambda device=None: True)
    assert resolve_dtype("auto", frozen_base=False) is torch.float32  # master weights stay fp32
    assert resolve_dtype("auto", frozen_base=True) is torch.bfloat16


def test_auto_is_fp32_without_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "fast_bf16", lambda device=None: False)
    assert resolve_dtype("auto", frozen_base=True) is torch.float32


def test_cpu_detection_follows_the_instruction_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert models.fast_bf16("cpu") is False
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert models.fast_bf16("cpu") is True


def test_unknown_dtype_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"model.init_args.dtype must be 'auto' or one of"):
        resolve_dtype("fp8", frozen_base=False)


def test_auto_lora_keeps_adapters_fp32_over_a_bf16_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "fast_bf16", lambda device=None: True)
    tokenizer = build_tiny_tokenizer()
    model = load_policy("tiny", tokenizer, "auto", "sdpa", LoraSettings(r=4, alpha=8))
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = model(input_ids=ids).logits
    logits.float().sum().backward()  # mixed base/adapter dtypes run forward and backward
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_one_dtype_table_serves_the_model_and_fsdp_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert distributed.DTYPES is models.DTYPES
    monkeypatch.setitem(models.DTYPES, "float64", torch.float64)  # a name added once is known to every option
    assert resolve_dtype("float64", frozen_base=False) is torch.float64
    strategy = distributed.FSDP2Strategy(param_dtype="float64", reduce_dtype="float64")
    policy = strategy.fsdp_kwargs()["mp_policy"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float64, torch.float64)
    with pytest.raises(ValueError, match=r"trainer.strategy.init_args.param_dtype must be one of \['bfloat16'"):
        distributed.FSDP2Strategy(param_dtype="fp8")
