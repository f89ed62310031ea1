"""LoRA rollouts on merged weights: the adapted model's distribution, the plain model's layers.

The engine swaps plain linear layers over merged copies ``W + scaling * B @ A`` in for peft's
layers during ``generate`` and puts them back after: the sampled tokens' log-probs must equal the
learner's under the adapters, follow every optimizer step, and leave the frozen base (which is also
the reference) bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sampler_and_learner_logprobs

from lightning_memrl import GenerationSettings, LoraSettings, MemRLModule
from lightning_memrl.rollout.hf import RolloutEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17], [18, 19, 20, 21, 22]]
SETTINGS = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)


def _module(target_modules: list[str] | str = "all-linear", dtype: str = "float32") -> MemRLModule:
    module = MemRLModule(
        "tiny",
        dtype=dtype,
        lora=LoraSettings(r=4, alpha=8, target_modules=target_modules),
        share_prefixes=False,
        generation=SETTINGS,
    )
    module.configure_model()
    module.policy.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # adapters that move the logits (peft starts B at zero)
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return module


def _sample(module: MemRLModule, engine: RolloutEngine, seed: int = 0) -> tuple[list, torch.Tensor, float]:
    """The engine's generations, the learner's log-probs of the same tokens, and their largest gap."""
    torch.manual_seed(seed)
    gens = engine.generate(PROMPTS, SETTINGS)
    learner, gap = sampler_and_learner_logprobs(module, module.policy, PROMPTS, gens)
    return gens, learner, gap


def _logits(module: MemRLModule) -> torch.Tensor:
    with torch.no_grad():
        return module.policy(input_ids=torch.tensor([PROMPTS[1]])).logits.float()


class _Calls:
    """Counts the forwards of every ``lora_A`` module (the adapters running through peft)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.count = 0
        modules = [m for name, m in model.named_modules() if name.endswith("lora_A.default")]
        self.handles = [m.register_forward_hook(lambda *_: self._add()) for m in modules]

    def _add(self) -> None:
        self.count += 1


def test_merged_rollout_samples_the_adapted_model_without_running_adapters() -> None:
    module = _module()
    calls = _Calls(module.policy)
    module.engine.generate(PROMPTS, SETTINGS)
    assert calls.count == 0  # no peft layer ran: plain layers over merged weights
    assert module.engine.merged.merged_mib == pytest.approx(2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) * 4 / 2**20)
    _, _, gap = _sample(module, module.engine)
    assert gap < 1e-5, f"merged rollout vs learner: {gap:.3g}"
    unmerged = RolloutEngine(module.policy, module.tokenizer, share_prefixes=False, merge_adapters=False)
    unmerged.generate(PROMPTS, SETTINGS)
    assert calls.count > 0  # through peft's layers
    _, _, gap_unmerged = _sample(module, unmerged)
    assert gap_unmerged < 1e-5
    with module.policy.disable_adapter():  # the adapters matter: the base gives other logits
        base = _logits(module)
    assert float((base - _logits(module)).abs().max()) > 1e-2


def test_merged_weights_follow_every_optimizer_step() -> None:
    module = _module()
    adapters = [p for p in module.policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=0.05)
    gaps = []
    for sync in (True, False):  # without the sync call the in-place change is still seen
        _sample(module, module.engine)
        before = _logits(module)
        torch.stack([p.sum() for p in adapters]).sum().backward()
        opt.step()
        opt.zero_grad()
        if sync:
            module.engine.sync_weights(module.policy)
        gaps.append(_sample(module, module.engine)[2])
        assert float((_logits(module) - before).abs().max()) > 1e-3  # the step changed the distribution
    assert max(gaps) < 1e-5, f"merged rollout vs learner after a step: {gaps}"


def test_rollouts_leave_the_base_and_the_reference_bit_identical() -> None:
    module = _module()
    policy = module.policy
    layers = {name: m for name, m in policy.named_modules() if name.endswith(("q_proj", "down_proj"))}
    base = {name: (p, p.detach().clone()) for name, p in policy.named_parameters() if "lora_" not in name}
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad(), policy.disable_adapter():
        reference = policy(input_ids=ids).logits
    for _ in range(2):
        _sample(module, module.engine)
        module.engine.sync_weights(policy)
    module.engine.release_memory()
    assert module.engine.merged.merged_mib == 0
    after = dict(policy.named_parameters())
    for name, (param, saved) in base.items():
        assert after[name] is param and torch.equal(param, saved), name  # same object, same bits
    assert {name: m for name, m in policy.named_modules() if name in layers} == layers  # peft layers back
    with torch.no_grad(), policy.disable_adapter():
        assert torch.equal(policy(input_ids=ids).logits, reference)


def test_disabled_adapters_and_unmergeable_layers_keep_their_path() -> None:
    module = _module(target_modules=["q_proj", "embed_tokens"])  # a LoRA embedding cannot be merged here
    assert len(module.engine.merged.targets) == 2  # the two q_proj layers
    _, _, gap = _sample(module, module.engine)
    assert gap < 1e-5, f"q_proj merged, embedding adapter running: {gap:.3g}"
    module.engine.release_memory()
    with module.policy.disable_adapter():  # frozen agents, the reference: the base, nothing merged
        _, _, gap = _sample(module, module.engine)
        assert module.engine.merged.merged_mib == 0
    assert gap < 1e-5


def test_module_rollout_frees_the_merged_weights() -> None:
    from lightning_memrl import MemRLDataModule, SyntheticTaskSettings

    module = _module()
    calls = _Calls(module.policy)
    data = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=2, sentences_per_chunk=1))
    data.setup()
    rollouts = module.rollout([t for t in data.train_tasks[:2] for _ in range(2)], module.generation)
    assert rollouts.response_mask.sum() > 0 and calls.count == 0  # every turn sampled from merged weights
    assert module.engine.merged.merged_mib == 0  # not held through the update


def test_bf16_base_adds_the_low_rank_products_itself_and_merges_only_when_asked(monkeypatch) -> None:
    from lightning_memrl.rollout import lowrank

    module = _module(dtype="bfloat16")
    calls = _Calls(module.policy)
    weights = []  # every weight the stand-ins multiply by: a group's stacked A or its block-diagonal scaling * B
    linear = lowrank.F.linear
    monkeypatch.setattr(lowrank.F, "linear", lambda x, w, b=None: weights.append(w) or linear(x, w, b))
    gens = module.engine.generate(PROMPTS, SETTINGS)  # default: bf16 bases keep their own weights
    monkeypatch.undo()
    assert calls.count == 0 and all(t.low_rank for t in module.engine.merged.targets)  # no peft layer ran
    groups = [group for group, _ in module.engine.merged._groups.values()]
    with_a = sum(any(w is g.a_all for g in groups) for w in weights)
    with_b = sum(any(w is g.b_all for g in groups) for w in weights)
    forwards = max(len(g.token_ids) for g in gens)  # the prefill, then one forward per further token
    # per decoder layer and forward: 7 adapted layers in 4 groups (q+k+v, o, gate+up, down), 2 products each
    assert (with_a, with_b, len(weights)) == (2 * forwards * 4, 2 * forwards * 4, 2 * forwards * 8)
    # per decoder layer, fp32: stacked A (q+k+v 12 x 64, o 4 x 64, gate+up 8 x 64, down 4 x 128) and the
    # block-diagonal scaling * B ([32+32+64, 12], [64, 4], [128+128, 8], [64, 4])
    a_elements, b_elements = 768 + 256 + 512 + 512, 128 * 12 + 64 * 4 + 256 * 8 + 64 * 4
    assert module.engine.merged.merged_mib == pytest.approx(2 * (a_elements + b_elements) * 4 / 2**20)
    _, _, gap = _sample(module, module.engine)
    assert gap < 1e-5, f"low-rank stand-ins vs the learner's peft layers, bf16: {gap:.3g}"
    with torch.inference_mode():  # predict's mode: tensors without a version counter
        greedy = GenerationSettings(temperature=0.0, max_new_tokens=8)
        served = module.engine.generate(PROMPTS, greedy)
    through_peft = RolloutEngine(module.policy, module.tokenizer, share_prefixes=False, merge_adapters=False)
    assert [g.token_ids for g in served] == [g.token_ids for g in through_peft.generate(PROMPTS, greedy)]
    asked = RolloutEngine(module.policy, module.tokenizer, share_prefixes=False, merge_adapters=True)
    calls.count = 0
    asked.generate(PROMPTS, SETTINGS)
    assert calls.count == 0 and asked.merged.merged_mib == pytest.approx(0.28125 / 2)  # bf16 merged copies
    _, _, gap = _sample(module, asked)
    assert 1e-4 < gap < 0.05, f"merged bf16 weights: {gap:.3g}"  # bf16 rounding, not another model


def test_low_rank_stand_ins_follow_every_optimizer_step_and_fall_back_with_gradients() -> None:
    from lightning_memrl.rollout.lowrank import LowRankStandIn

    module = _module(dtype="bfloat16")
    adapters = [p for p in module.policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=0.05, foreach=False, fused=True)  # fused: writes without a version bump
    _sample(module, module.engine)
    before = _logits(module)
    torch.stack([p.sum() for p in adapters]).sum().backward()
    opt.step()
    opt.zero_grad()
    module.engine.sync_weights(module.policy)
    _, _, gap = _sample(module, module.engine)
    assert float((_logits(module) - before).abs().max()) > 1e-3 and gap < 1e-5, f"after a step: {gap:.3g}"
    target = module.engine.merged.targets[0]
    x = torch.randn(3, target.layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = target.layer(x)
    with module.engine.sampling_weights():
        stand_in = target.parent._modules[target.attr]
        assert isinstance(stand_in, LowRankStandIn)
        with torch.no_grad():
            served = stand_in(x)
        with torch.enable_grad():
            through_peft = stand_in(x.requires_grad_())
    torch.testing.assert_close(served, expected, atol=0, rtol=0)
    torch.testing.assert_close(through_peft, expected, atol=0, rtol=0)
    through_peft.sum().backward()
    assert target.layer.lora_A["default"].weight.grad is not None
    module.engine.release_memory()
    assert module.engine.merged.merged_mib == 0


def test_packed_rollout_holds_one_copy_of_each_merged_weight() -> None:
    from lightning_memrl.rollout.packed import PackedStandIn

    module = _module()
    engine = module.engine
    assert engine.packed is not None  # CPU: packed weights are the default
    greedy = GenerationSettings(temperature=0.0, max_new_tokens=8)
    packed = engine.generate(PROMPTS, greedy)
    targets = engine.merged.targets
    adapted = {id(t.layer.base_layer) for t in targets}
    assert engine.merged._buffers == [] and all(isinstance(t.plain, PackedStandIn) for t in targets)
    assert engine.merged.merged_mib == pytest.approx(
        sum(t.layer.base_layer.weight.numel() for t in targets) * 4 / 2**20
    )
    others = [  # plain layers neither adapted nor adapters: packed by PackedLinears (here the LM head)
        m
        for n, m in module.policy.named_modules()
        if type(m) is torch.nn.Linear and "lora_" not in n and id(m) not in adapted
    ]
    assert others and engine.packed.packed_mib == pytest.approx(sum(m.weight.numel() for m in others) * 4 / 2**20)
    unpacked = RolloutEngine(module.policy, module.tokenizer, share_prefixes=False, pack_weights=False)
    plain = unpacked.generate(PROMPTS, greedy)
    assert unpacked.merged.merged_mib == pytest.approx(engine.merged.merged_mib)  # a plain merged copy instead
    assert [g.token_ids for g in packed] == [g.token_ids for g in plain]
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    engine.release_memory()
    assert engine.merged.merged_mib == 0 and engine.packed.packed_mib == 0


def test_packed_stand_in_runs_the_peft_layer_with_gradients_on() -> None:
    from lightning_memrl.rollout.packed import PackedStandIn

    module = _module()
    engine = module.engine
    target = engine.merged.targets[0]
    x = torch.randn(3, target.layer.in_features)
    with torch.no_grad():
        expected = target.layer(x)
    with engine.sampling_weights():
        stand_in = target.parent._modules[target.attr]
        assert isinstance(stand_in, PackedStandIn)
        with torch.no_grad():
            packed = stand_in(x)  # the packed merged weight
        with torch.enable_grad():
            through_peft = stand_in(x.requires_grad_())  # the peft layer: adapters in the graph
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(through_peft, expected, atol=0, rtol=0)
    through_peft.sum().backward()
    assert target.layer.lora_B["default"].weight.grad is not None


def _low_rank_engine(module: MemRLModule, pack_weights: bool) -> RolloutEngine:
    """An engine serving every adapted layer by a LowRankStandIn (forced on the fp32 tiny model, where packing is
    available on every CPU)."""
    engine = RolloutEngine(module.policy, module.tokenizer, share_prefixes=False, pack_weights=pack_weights)
    for target in engine.merged.targets:
        target.low_rank = True
    return engine


def test_stacked_bases_give_each_low_rank_group_one_rounded_output() -> None:
    from lightning_memrl.rollout.lowrank import LowRankStandIn

    module = _module()
    engine = _low_rank_engine(module, pack_weights=True)
    attention = engine.merged.targets[0].parent
    x = torch.randn(2, 3, attention.q_proj.in_features)
    with torch.no_grad():
        expected = [attention.get_submodule(n)(x) for n in ("q_proj", "k_proj", "v_proj")]
    with torch.no_grad(), engine.sampling_weights():
        stand_ins = [attention.q_proj, attention.k_proj, attention.v_proj]
        group = stand_ins[0].group
        assert all(isinstance(m, LowRankStandIn) and m.group is group for m in stand_ins)
        assert group.stacked_base is not None and len(group.members) == 3  # q/k/v; o_proj has its own group
        got = [stand_ins[0](x), stand_ins[1](x)]
        assert group._input is x  # held until the last member takes its columns
        got.append(stand_ins[2](x))
        assert group._input is None and group._product is None
        assert isinstance(attention.o_proj, LowRankStandIn) and attention.o_proj.group.stacked_base is None
    assert group.stacked_base is None  # outside a rollout each member adds its own base product
    assert len({out.untyped_storage().data_ptr() for out in got}) == 1  # one output, three column ranges
    for out, want in zip(got, expected):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    greedy = GenerationSettings(temperature=0.0, max_new_tokens=8)
    stacked = engine.generate(PROMPTS, greedy)
    unstacked = _low_rank_engine(module, pack_weights=False).generate(PROMPTS, greedy)  # a member at a time
    assert [g.token_ids for g in stacked] == [g.token_ids for g in unstacked]
    for a, b in zip(stacked, unstacked):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    _, _, gap = _sample(module, engine)
    assert gap < 1e-4, f"stacked low-rank groups vs the learner's peft layers, fp32: {gap:.3g}"
    engine.release_memory()  # the group lets go of its factors and members at once (they refer to each other)
    assert group.a_all is None and group.b_all is None and group.members == [] and engine.merged.merged_mib == 0
