"""Rollouts on oneDNN-packed linear weights: the same products, the same sampled tokens, fresh after every change.

Inside ``PackedLinears.swapped`` every plain CPU ``nn.Linear`` computes with a packed copy of its
weight; outside, and whenever gradients are on, with its own. A pack is remade after ``sync_weights``
(the learner's call after every optimizer step) and when its weight changed by a counted in-place
write; the engine's log-probs stay the learner's, with and without LoRA, before and after optimizer
steps; ``release`` frees the packs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sampler_and_learner_logprobs
from torch import nn

from lightning_memrl import GenerationSettings, LoraSettings, MemRLModule
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.packed import PackedLinears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(torch.float32), reason="this torch build has no oneDNN")

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17], [18, 19, 20, 21, 22]]
SAMPLED = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=8)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def test_packed_layers_compute_the_same_products_and_are_restored(tiny_model):
    packed = PackedLinears(tiny_model)
    x = torch.randn(3, 5, tiny_model.config.hidden_size)
    layer = tiny_model.model.layers[0].mlp.up_proj
    expected = layer(x)
    with torch.no_grad(), packed.swapped() as count:
        assert count == len(_linears(tiny_model)) > 0  # every projection and the LM head
        assert "forward" in vars(layer)  # routed through the pack
        got = layer(x)
    assert "forward" not in vars(layer)  # nn.Linear's own forward again
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = sum(m.weight.numel() * 4 for m in _linears(tiny_model)) / 2**20
    assert packed.packed_mib == pytest.approx(weights)  # one fp32 copy of each packed weight
    packed.release()
    assert packed.packed_mib == 0


def test_gradients_on_inside_take_the_layers_own_forward(tiny_model):
    layer = tiny_model.model.layers[0].mlp.up_proj
    with PackedLinears(tiny_model).swapped():
        layer(torch.randn(2, tiny_model.config.hidden_size)).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_a_weight_changed_in_place_is_packed_again(tiny_model):
    packed = PackedLinears(tiny_model)
    layer = tiny_model.model.layers[0].self_attn.o_proj
    x = torch.randn(4, layer.in_features)
    with torch.no_grad():
        with packed.swapped():
            before = layer(x)
        layer.weight.mul_(2.0)  # what an optimizer step does: in place, no invalidate
        with packed.swapped():
            after = layer(x)
    torch.testing.assert_close(after, 2.0 * before, atol=1e-5, rtol=1e-5)


def test_inference_tensor_weights_are_packed(tiny_model):
    """Weights made under ``inference_mode`` (a model loaded for ``predict``) keep no version counter."""
    layer = tiny_model.model.layers[0].mlp.up_proj
    x = torch.randn(2, layer.in_features)
    expected = layer(x).detach()
    with torch.inference_mode():
        frozen = nn.Linear(layer.in_features, layer.out_features, bias=False)
        frozen.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        holder = nn.Sequential(frozen)
        packed = PackedLinears(holder)
        with packed.swapped() as count:
            got = frozen(x)
        with packed.swapped():  # unchanged: the pack is kept
            again = frozen(x)
    assert count == 1 and frozen.weight.is_inference()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, got)


def test_engine_samples_the_same_greedy_tokens_with_and_without_packing(tiny_model, tiny_tokenizer):
    plain = RolloutEngine(tiny_model, tiny_tokenizer, pack_weights=False).generate(PROMPTS, GREEDY)
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    packed = engine.generate(PROMPTS, GREEDY)
    assert engine.packed.packed_mib > 0
    assert [g.token_ids for g in packed] == [g.token_ids for g in plain]
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    engine.release_memory()
    assert engine.packed.packed_mib == 0


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_log_probs_equal_the_learners_after_every_optimizer_step(lora):
    module = MemRLModule("tiny", lora=lora, share_prefixes=False, generation=SAMPLED)
    module.configure_model()
    policy = module.policy.eval()
    assert module.engine.packed is not None
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=0.05, fused=True)  # the learner's optimizer kernel
    for _ in range(3):
        torch.manual_seed(0)
        _, gap = sampler_and_learner_logprobs(module, policy, PROMPTS, module.engine.generate(PROMPTS, SAMPLED))
        assert gap < 1e-4, f"packed rollout vs learner: {gap:.3g}"
        torch.stack([p.sum() for p in trained]).sum().neg().backward()
        opt.step()  # fused AdamW writes the weights without counting a version: sync_weights marks the packs stale
        opt.zero_grad()
        module.engine.sync_weights(policy)  # what the learner calls after every optimizer step


def test_lora_adapter_layers_keep_their_own_forward():
    module = MemRLModule("tiny", lora=LoraSettings(r=4, alpha=8), share_prefixes=False, generation=SAMPLED)
    module.configure_model()
    policy = module.policy.eval()
    adapters = [m for name, m in policy.named_modules() if ".lora_A." in name or ".lora_B." in name]
    bases = [m for m in _linears(policy) if m not in adapters]
    assert adapters and bases
    with torch.no_grad(), PackedLinears(policy).swapped() as count:
        assert count == len(bases)
        assert all("forward" in vars(m) for m in bases) and not any("forward" in vars(m) for m in adapters)


def test_sibling_layers_share_one_stacked_pack(tiny_model):
    attention = tiny_model.model.layers[0].self_attn
    x, other = torch.randn(2, 3, attention.q_proj.in_features), torch.randn(2, 3, attention.q_proj.in_features)
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    expected = [layer(x) for layer in projections]
    packed = PackedLinears(tiny_model)
    with torch.no_grad(), packed.swapped():
        got = [attention.q_proj(x), attention.k_proj(x)]
        fused = next(f for members, f in packed._fused.items() if members[0] is attention.q_proj)
        assert fused._input is x  # held until the last member takes its columns
        got.append(attention.v_proj(x))
        assert fused._input is None and fused._product is None  # then dropped: only the callers hold the outputs
        alone = attention.k_proj(other)  # another input: the stacked product of that input
    assert len(packed._fused) == 2 * len(tiny_model.model.layers)  # q/k/v and gate/up of every layer
    assert len({out.untyped_storage().data_ptr() for out in got}) == 1  # one product, three column ranges
    for out, want in zip(got, expected):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, attention.k_proj(other), atol=1e-5, rtol=1e-5)
    assert all(fused._input is None for fused in packed._fused.values())  # no input held after the rollout


def test_a_stacked_member_changed_in_place_is_packed_again(tiny_model):
    packed = PackedLinears(tiny_model)
    mlp = tiny_model.model.layers[0].mlp
    x = torch.randn(4, mlp.up_proj.in_features)
    with torch.no_grad():
        with packed.swapped():
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        mlp.up_proj.weight.mul_(2.0)  # in place, no invalidate
        with packed.swapped():
            gate_after, up_after = mlp.gate_proj(x), mlp.up_proj(x)
    torch.testing.assert_close(up_after, 2.0 * up, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate_after, gate)
