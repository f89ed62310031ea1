"""A load that casts reads the safetensors file with pread (no transient mapped copy); other loads map it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import modeling_utils

from lightning_memrl.cast_loading import casts, file_float_dtypes, read_when_casting
from lightning_memrl.models import build_tiny_model, load_policy


@pytest.fixture()
def fp32_folder(tmp_path, tiny_tokenizer):
    model = build_tiny_model(tiny_tokenizer, seed=3, dtype=torch.float32)
    model.save_pretrained(tmp_path / "fp32", safe_serialization=True)
    tiny_tokenizer.save_pretrained(tmp_path / "fp32")
    return tmp_path / "fp32", model


@pytest.fixture()
def backends(monkeypatch):
    """The ``backend`` of every ``safe_open`` call transformers makes (None: not given)."""
    seen: list[str | None] = []
    original = modeling_utils.safe_open

    def spy(file, *args, backend=None, **kwargs):
        seen.append(backend)
        return original(file, *args, **kwargs) if backend is None else original(file, *args, backend=backend, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_open", spy)
    return seen


def test_header_dtypes_and_casts(tmp_path):
    path = str(tmp_path / "mixed.safetensors")
    save_file({"w": torch.zeros(2, dtype=torch.float32), "n": torch.zeros(2, dtype=torch.int64)}, path)
    assert file_float_dtypes(path) == {torch.float32}  # integer tensors are never cast
    assert casts(path, torch.bfloat16) and not casts(path, torch.float32)
    (tmp_path / "broken.safetensors").write_bytes(b"\x05\x00")
    assert file_float_dtypes(str(tmp_path / "broken.safetensors")) == set()


def test_bf16_load_of_fp32_file_reads_with_pread_and_gives_the_cast_weights(fp32_folder, tiny_tokenizer, backends):
    folder, fp32_model = fp32_folder
    model = load_policy(str(folder), tiny_tokenizer, dtype="bfloat16")
    assert "pread" in backends and "mmap" not in backends
    loaded = model.state_dict()
    for name, weight in fp32_model.state_dict().items():
        assert torch.equal(loaded[name], weight.to(torch.bfloat16)), name
    assert modeling_utils.safe_open.__name__ == "spy"  # transformers' own function back in place


def test_same_dtype_load_keeps_the_mapping(fp32_folder, tiny_tokenizer, backends):
    folder, fp32_model = fp32_folder
    model = load_policy(str(folder), tiny_tokenizer, dtype="float32")
    assert "mmap" in backends and "pread" not in backends
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fp32_model.state_dict().items())


def test_switch_is_undone_after_an_error():
    original = modeling_utils.safe_open
    with pytest.raises(RuntimeError, match="boom"), read_when_casting(torch.bfloat16):
        assert modeling_utils.safe_open is not original
        raise RuntimeError("boom")
    assert modeling_utils.safe_open is original
