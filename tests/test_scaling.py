"""Memory and speed options: QLoRA (4-bit base + LoRA), gradient checkpointing, attention choice."""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch
from helpers import AnswerLength, quiet_trainer, scored_rollouts

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    LoraSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
    learner,
)
from lightning_memrl.models import QuantizationSettings, build_tiny_model, load_policy, resolve_attn_implementation


def _data() -> MemRLDataModule:
    return MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=4, sentences_per_chunk=1))


def _module(**kwargs) -> MemRLModule:
    return MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        optimizer=OptimizerSettings(lr=1e-2),
        **kwargs,
    )


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_tokenizer):
    """The tiny model saved as a normal model folder (quantisation loads through from_pretrained)."""
    path = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(tiny_tokenizer, seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return str(path)


def _dequantized(layer) -> torch.Tensor:
    """A 4-bit layer's weight de-quantised to fp32, whichever layout bitsandbytes keeps it in.

    A weight repacked for the AVX512-BF16 CPU kernel is unpacked from a copy first (the module
    keeps its layout); the 4-bit codes survive the repack exactly, the constants to bf16 precision.
    """
    import bitsandbytes.functional as bnb_f

    data, state = layer.weight.data, layer.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        data, state = bnb_f._convert_weight_packed_for_cpu_inverse(data.clone(), copy.deepcopy(state))
    return bnb_f.dequantize_4bit(data, state).float()


def test_qlora_loads_4bit_trains_adapters_and_keeps_base_frozen(saved_tiny, tmp_path):
    from bitsandbytes.nn import Linear4bit

    quant = QuantizationSettings(bnb_4bit_compute_dtype="float32")
    module = _module(
        model_name_or_path=saved_tiny,
        lora=LoraSettings(r=4, alpha=8),
        quantization=quant,
        grpo=GRPOSettings(group_size=2, kl_coef=0.1),
    )
    module.configure_model()
    assert module._reference is None  # the reference is the 4-bit base with adapters disabled
    layers = [m for m in module.policy.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 14  # 7 projections x 2 layers
    assert all(m.weight.dtype == torch.uint8 for m in layers)
    base_before = {id(m): _dequantized(m) for m in layers}
    adapters_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters_before and all("lora_" in n for n in adapters_before)

    trainer = quiet_trainer(tmp_path, steps=1)
    trainer.fit(module, _data())
    logged = trainer.logged_metrics
    assert math.isfinite(float(logged["train/loss"])) and math.isfinite(float(logged["train/kl"]))
    after = dict(module.policy.named_parameters())
    assert any(not torch.equal(adapters_before[n], after[n]) for n in adapters_before)
    for m in layers:  # still 4-bit, and the base did not train: de-quantised weights equal bit for bit
        assert isinstance(m, Linear4bit) and m.weight.dtype == torch.uint8
        assert torch.equal(_dequantized(m), base_before[id(m)])

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        adapted = module.policy(input_ids=ids).logits
        with module.reference_context():
            reference = module.policy(input_ids=ids).logits
    assert torch.isfinite(reference).all() and not torch.allclose(reference, adapted)


def test_base_check_reads_a_weight_repacked_for_the_cpu_kernel(saved_tiny, tiny_tokenizer):
    """The repack itself (pure tensor code, runs on any CPU): same codes, constants to bf16 precision."""
    import bitsandbytes.functional as bnb_f
    from bitsandbytes.nn import Linear4bit

    policy = load_policy(saved_tiny, tiny_tokenizer, lora=LoraSettings(r=4), quantization=QuantizationSettings())
    layer = next(m for m in policy.modules() if isinstance(m, Linear4bit))
    before = _dequantized(layer)
    shape = tuple(layer.weight.data.shape)
    layer.weight.data, layer.weight.quant_state = bnb_f._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state
    )
    assert tuple(layer.weight.data.shape) != shape  # what made the old uint8 comparison fail
    repacked = _dequantized(layer)
    assert repacked.shape == before.shape
    torch.testing.assert_close(repacked, before, rtol=0, atol=float(before.abs().max()) * 2**-7)


def test_qlora_update_is_the_same_on_a_cpu_that_repacks_4bit_weights(saved_tiny, monkeypatch):
    """An AVX512-BF16 CPU is simulated by its capability check; the policy keeps the portable layout there."""
    import bitsandbytes.nn.modules as bnb_modules
    from bitsandbytes.nn import Linear4bit

    qlora = {"model_name_or_path": saved_tiny, "quantization": QuantizationSettings(bnb_4bit_compute_dtype="float32")}
    stats, grads, rollouts, lora_state, _ = _update_grads(False, **qlora)
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    shapes: dict[str, list[tuple]] = {}

    def before_update(module):  # an eval, no-grad rollout first: where bitsandbytes would repack
        layers = {n: m for n, m in module.policy.named_modules() if isinstance(m, Linear4bit)}
        shapes.update({n: [tuple(m.weight.data.shape)] for n, m in layers.items()})
        task = rollouts.trajectories[0].task
        module.rollout([task, task], module.generation)
        for n, m in layers.items():
            shapes[n].append(tuple(m.weight.data.shape))

    stats_b, grads_b, _, _, _ = _update_grads(False, rollouts, lora_state, before_update=before_update, **qlora)
    assert stats_b["loss"] == pytest.approx(stats["loss"], rel=1e-6, abs=1e-8)
    assert stats_b["kl"] == pytest.approx(stats["kl"], rel=1e-6, abs=1e-9)
    assert grads and set(grads_b) == set(grads) and any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-6, atol=1e-8, msg=name)
    assert len(shapes) == 14 and all(before == after for before, after in shapes.values())  # never repacked


def test_quantization_errors_name_the_option(saved_tiny, tiny_tokenizer):
    with pytest.raises(ValueError, match="quantization needs model.init_args.lora"):
        load_policy(saved_tiny, tiny_tokenizer, quantization=QuantizationSettings())
    with pytest.raises(ValueError, match="needs a saved model"):
        load_policy("tiny", tiny_tokenizer, lora=LoraSettings(), quantization=QuantizationSettings())
    with pytest.raises(ValueError, match="bnb_4bit_quant_type must be 'nf4' or 'fp4'"):
        QuantizationSettings(bnb_4bit_quant_type="int3").to_bnb_config()
    config = QuantizationSettings().to_bnb_config()
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16 and config.bnb_4bit_use_double_quant


def _update_grads(gradient_checkpointing: bool, rollouts=None, lora_state=None, before_update=None, **kwargs):
    """Loss and LoRA gradients of one GRPO update on fixed rollouts (optimizer step captured)."""
    kwargs.setdefault("share_prefixes", False)  # same decoder calls with and without checkpointing by default
    module = _module(
        lora=LoraSettings(r=4, alpha=8),
        gradient_checkpointing=gradient_checkpointing,
        grpo=GRPOSettings(group_size=2, kl_coef=0.1, max_grad_norm=0.0),
        **kwargs,
    )
    module.configure_model()
    if lora_state is None:
        torch.manual_seed(1)
        with torch.no_grad():  # non-zero lora_B so every adapter gets a gradient
            for name, p in module.policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    else:
        module.policy.load_state_dict(lora_state, strict=False)
    if rollouts is None:
        data = _data()
        data.setup()
        torch.manual_seed(0)
        rollouts = scored_rollouts(module, data, [1.0, 0.0, 0.5, 0.0])

    captured = {}

    class _Opt:
        param_groups = [{"lr": 0.0}]

        def step(self):
            captured.update({n: p.grad.clone() for n, p in module.policy.named_parameters() if p.requires_grad})

        def zero_grad(self, set_to_none=True):
            module.policy.zero_grad(set_to_none=True)

    opt = _Opt()
    module.optimizers = lambda: opt
    module.lr_schedulers = lambda: None
    module.manual_backward = lambda loss: loss.backward()
    mlp = module.policy.get_base_model().model.layers[0].mlp  # inside the checkpointed layer
    calls, forward = [], mlp.forward

    def counting_forward(*args, **kwargs):  # module hooks do not fire in the recomputation, forward does
        calls.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    mlp.forward = counting_forward
    if before_update is not None:
        before_update(module)
    stats = module.update(rollouts)
    state = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "lora_" in n}
    return stats, captured, rollouts, state, calls


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    stats_off, grads_off, rollouts, lora_state, calls_off = _update_grads(False)
    stats_on, grads_on, _, _, calls_on = _update_grads(True, rollouts, lora_state)
    # checkpointing runs layer 0 again in backward: one more forward call of its MLP per micro-batch
    assert len(calls_on) > len(calls_off)
    assert stats_on["loss"] == pytest.approx(stats_off["loss"], rel=1e-5, abs=1e-7)
    assert stats_on["kl"] == pytest.approx(stats_off["kl"], rel=1e-4, abs=1e-7)
    assert grads_off and set(grads_on) == set(grads_off)
    assert any(g.abs().sum() > 0 for g in grads_off.values())
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_keeps_shared_prefixes_with_the_same_loss_and_gradients(monkeypatch):
    shared = []
    real = learner.shared_prefix_hidden
    monkeypatch.setattr(learner, "shared_prefix_hidden", lambda *a, **k: shared.append(1) or real(*a, **k))
    stats_off, grads_off, rollouts, lora_state, calls_off = _update_grads(False, share_prefixes=True)
    used_off, shared[:] = len(shared), []
    stats_on, grads_on, _, _, calls_on = _update_grads(True, rollouts, lora_state, share_prefixes=True)
    assert used_off > 0 and len(shared) == used_off  # the prefixes are still computed once per group
    assert len(calls_on) > len(calls_off)  # and the layers run again in backward
    assert stats_on["loss"] == pytest.approx(stats_off["loss"], rel=1e-6, abs=1e-8)
    assert stats_on["kl"] == pytest.approx(stats_off["kl"], rel=1e-5, abs=1e-8)
    assert grads_off and set(grads_on) == set(grads_off)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_attn_auto_picks_flash_attention_on_cuda_when_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name))
    assert resolve_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cuda") == "eager"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name))
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"
