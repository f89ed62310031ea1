"""MemRLModule in process: the GRPO step, reference handling, micro-batching, overrides."""

from __future__ import annotations

import lightning as L
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
)
from lightning_memrl.advantages import AdvantageEstimator, GroupRelative
from lightning_memrl.callbacks import MemRLCallback
from lightning_memrl.learner import micro_batches


def _data(**kwargs):
    return MemRLDataModule(
        batch_size=2,
        val_batch_size=4,
        synthetic=SyntheticTaskSettings(num_tasks=8, sentences_per_chunk=1),
        synthetic_val=SyntheticTaskSettings(num_tasks=4, seed=99, sentences_per_chunk=1),
        **kwargs,
    )


def _module(**grpo_kwargs):
    return MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, **grpo_kwargs),
        optimizer=OptimizerSettings(lr=1e-3),
    )


_trainer = quiet_trainer


def test_micro_batches_respect_budget_and_cover_rows():
    lengths = [5, 30, 7, 12, 40, 6]
    batches = micro_batches(lengths, token_budget=40)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 40
    assert batches[0] == [0, 5, 2]  # sorted by length: similar lengths share a micro-batch


class _Recorder(MemRLCallback):
    def __init__(self):
        self.calls = []

    def on_rewards(self, trainer, module, rollouts):
        self.calls.append(("rewards", rollouts.rewards.shape[0]))
        assert rollouts.advantages.numel() == 0  # advantages do not exist yet

    def on_advantages(self, trainer, module, rollouts):
        self.calls.append(("advantages", tuple(rollouts.advantages.shape)))
        # every token of every turn of a trajectory carries the trajectory's advantage
        per_turn = rollouts.trajectory_advantages[rollouts.turn_to_trajectory]
        assert torch.equal(rollouts.advantages, per_turn[:, None] * rollouts.response_mask)


def test_training_changes_weights_and_calls_callbacks_in_order(tmp_path):
    module, recorder = _module(kl_coef=0.0), _Recorder()
    trainer = _trainer(tmp_path, callbacks=[recorder])
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, _data())
    assert module._reference is None  # kl_coef 0: no reference model at all
    assert trainer.global_step == 2
    changed = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, before[k])]
    assert changed
    assert [c[0] for c in recorder.calls] == ["rewards", "advantages"] * 2
    assert recorder.calls[0][1] == 4  # 2 tasks x group 2
    logged = trainer.logged_metrics
    assert logged["train/reward/answer_length"] >= 0 and "train/kl" not in logged
    assert logged["train/turns_per_trajectory"] >= 2
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["fused"] is True  # one kernel per tensor, not the per-parameter loop
    assert all(float(state["step"]) == 2.0 for state in optimizer.state.values())


def test_kl_reference_full_copy_is_frozen_and_lora_uses_disabled_adapter(tmp_path):
    module = _module(kl_coef=0.1)
    module.configure_model()
    assert module._reference is not None
    assert not any(p.requires_grad for p in module._reference.parameters())
    assert not any(k.startswith("_reference") for k in module.state_dict())  # not checkpointed
    lora = MemRLModule(
        lora=LoraSettings(r=4, alpha=8),
        grpo=GRPOSettings(kl_coef=0.1, group_size=2),
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        generation=GenerationSettings(max_new_tokens=8),
    )
    lora.configure_model()
    assert lora._reference is None  # no second copy with LoRA
    trainable = [n for n, p in lora.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.nn.init.normal_(next(p for n, p in lora.policy.named_parameters() if "lora_B" in n))
        with lora.reference_context():
            ref = lora.policy(input_ids=ids).logits
        base = lora.policy.get_base_model()
        with lora.policy.disable_adapter():
            plain = base(input_ids=ids).logits
        adapted = lora.policy(input_ids=ids).logits
    torch.testing.assert_close(ref, plain)
    assert not torch.allclose(ref, adapted)
    _trainer(tmp_path, steps=1).fit(lora, _data())


def _grads_after_update(micro_batch_tokens, aggregation):
    torch.manual_seed(0)
    module = _module(
        kl_coef=0.1, micro_batch_tokens=micro_batch_tokens, loss_aggregation=aggregation, max_grad_norm=0.0
    )
    module.configure_model()
    tasks = _data()
    tasks.setup()
    rollouts = scored_rollouts(module, tasks, [1.0, 0.0, 0.5, 0.0])

    class _Opt:  # capture gradients instead of stepping
        param_groups = [{"lr": 0.0}]

        def step(self):
            self.grads = [p.grad.clone() for p in module.policy.parameters()]

        def zero_grad(self, set_to_none=True):
            module.policy.zero_grad(set_to_none=True)

    opt = _Opt()
    module.optimizers = lambda: opt
    module.lr_schedulers = lambda: None
    module.manual_backward = lambda loss: loss.backward()
    stats = module.update(rollouts)
    return opt.grads, stats


@pytest.mark.parametrize("aggregation", ["token_mean", "rollout_mean"])
def test_micro_batch_split_does_not_change_the_gradient(aggregation):
    whole, stats_whole = _grads_after_update(100_000, aggregation)
    split, stats_split = _grads_after_update(1, aggregation)  # one row per micro-batch
    assert stats_split["micro_batches"] > stats_whole["micro_batches"] == 1
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert stats_whole["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any step


class FixedAdvantages(AdvantageEstimator):
    """A user estimator: every trajectory gets +1, so the loss is the negated mean ratio."""

    def from_rewards(self, rewards, group_size):
        self.calls = getattr(self, "calls", 0) + 1
        return torch.ones(rewards.shape[0])


def test_default_advantage_is_grpo_group_relative():
    advantage = MemRLModule().advantage
    assert type(advantage) is GroupRelative and (advantage.scale_rewards, advantage.eps) == ("group", 1e-4)


def test_advantage_estimator_from_init_arg(tmp_path):
    estimator = FixedAdvantages()
    module = MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        advantage=estimator,
        grpo=GRPOSettings(group_size=2),
        generation=GenerationSettings(max_new_tokens=8),
        optimizer=OptimizerSettings(lr=1e-3),
    )
    seen = []

    class Spy(MemRLCallback):
        def on_advantages(self, trainer, module, rollouts):
            seen.append(rollouts.advantages[rollouts.response_mask.bool()].unique().tolist())

    _trainer(tmp_path, steps=1, callbacks=[Spy()]).fit(module, _data())
    assert estimator.calls == 1 and seen == [[1.0]]
    # on-policy ratio is 1 everywhere, so token_mean loss of A=+1 is exactly -1
    assert module.trainer.logged_metrics["train/loss"].item() == pytest.approx(-1.0, abs=1e-5)


def test_validation_logs_exact_match_and_f1(tmp_path):
    module = _module()
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    (metrics,) = trainer.validate(module, _data())
    assert set(metrics) >= {"val/exact_match", "val/f1", "val/reward"}
    assert 0.0 <= metrics["val/f1"] <= 1.0


def test_gradient_checkpointing_with_lora_trains(tmp_path):
    module = MemRLModule(
        lora=LoraSettings(r=4, alpha=8),
        gradient_checkpointing=True,
        rewards=[AnswerLength()],
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2),
        optimizer=OptimizerSettings(lr=1e-2),
    )
    module.configure_model()
    base = module.policy.get_base_model()
    assert base.is_gradient_checkpointing and not base.config.use_cache
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    _trainer(tmp_path, steps=1).fit(module, _data())
    after = dict(module.policy.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
