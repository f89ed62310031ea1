"""Turns whose gradient is exactly zero get no forward or backward pass (``grpo.skip_zero_advantage``),
and skipping them leaves the gradient, the optimizer's moments and the weights as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_module import _data, _module

from lightning_memrl import GRPOSettings, OptimizerSettings
from lightning_memrl.advantages import assign_advantages
from lightning_memrl.evaluation.report import step_metrics
from lightning_memrl.losses import rows_without_gradient
from lightning_memrl.settings import build_optimizer

# two groups of two: the first group's rewards differ, the second's are equal (advantage exactly 0)
REWARDS = [1.0, 0.0, 0.5, 0.5]


@pytest.fixture(scope="module")
def rollouts():
    """One tiny MemAgent batch (memory and answer turns), rolled out once for every test here."""
    torch.manual_seed(0)
    module = _module()
    module.configure_model()
    tasks = _data()
    tasks.setup()
    return module.rollout([t for t in tasks.train_tasks[:2] for _ in range(2)], module.generation)


def _fresh(**grpo):
    module = _module(max_grad_norm=0.0, **grpo)
    module.configure_model()  # the tiny model's weights come from a fixed seed: every module starts the same
    calls = []
    plain = module.sequence_logprobs
    module.sequence_logprobs = lambda *args, **kwargs: calls.append(len(args[1])) or plain(*args, **kwargs)
    module.manual_backward = lambda loss: loss.backward()
    return module, calls


def _grads(rollouts, rewards, **grpo):
    """The policy gradient ``update`` hands the optimizer, the rows each forward pass computed, and the stats."""
    module, calls = _fresh(**grpo)
    rollouts.rewards = torch.tensor(rewards)
    assign_advantages(rollouts, module.advantage)
    captured = []

    class _Opt:  # capture gradients instead of stepping
        param_groups = [{"lr": 0.0}]

        def step(self):
            captured.append([None if p.grad is None else p.grad.clone() for p in module.policy.parameters()])

        def zero_grad(self, set_to_none=True):
            module.policy.zero_grad(set_to_none=True)

    module.optimizers, module.lr_schedulers = (lambda: _Opt()), (lambda: None)
    stats = module.update(rollouts)
    return captured[-1], calls, stats


def _zero_advantage_rows(rollouts) -> torch.Tensor:
    return rollouts.turn_to_trajectory >= 2  # the second group's trajectories


@pytest.mark.parametrize(
    "options",
    [
        {"loss_aggregation": "token_mean"},
        {"loss_aggregation": "seq_mean_token_mean"},
        {"loss_aggregation": "seq_mean_token_sum_norm"},
        {"loss_aggregation": "rollout_mean"},
        {"loss_aggregation": "rollout_mean", "loss_type": "cispo"},
        {"loss_aggregation": "token_mean", "importance_sampling_level": "sequence", "dual_clip": 3.0},
        {"loss_aggregation": "token_mean", "ppo_epochs": 2},
    ],
)
def test_skipping_zero_advantage_turns_leaves_the_gradient_unchanged(rollouts, options):
    full, full_calls, full_stats = _grads(rollouts, REWARDS, skip_zero_advantage=False, **options)
    skipped, calls, stats = _grads(rollouts, REWARDS, **options)
    inert = _zero_advantage_rows(rollouts)
    epochs = options.get("ppo_epochs", 1)
    passes = epochs + (epochs > 1)  # each epoch's, and the old log-probs' with several epochs
    assert sum(full_calls) == rollouts.response_ids.shape[0] * passes
    assert sum(calls) == int((~inert).sum()) * passes  # every pass left the second group out
    assert stats["skipped_rows"] == float(inert.sum()) and full_stats["skipped_rows"] == 0.0
    assert stats["skipped_tokens"] == float(rollouts.response_mask[inert].sum()) > 0
    assert stats["loss"] == pytest.approx(full_stats["loss"], abs=1e-7)
    assert any(g is not None and float(g.abs().max()) > 0 for g in full)
    for a, b in zip(full, skipped):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)  # fp32


@pytest.mark.parametrize("options", [{"kl_coef": 0.1}, {"entropy_coef": 0.01}, {"top_entropy_quantile": 0.5}])
def test_no_turn_is_skipped_when_a_term_besides_the_advantage_trains_it(rollouts, options):
    _, calls, stats = _grads(rollouts, REWARDS, **options)
    assert stats["skipped_rows"] == 0.0 and stats["skipped_tokens"] == 0.0
    assert sum(calls) == rollouts.response_ids.shape[0] * (2 if "kl_coef" in options else 1)  # (+ reference pass)


def test_rows_without_gradient_rule():
    g = GRPOSettings()
    advantages = torch.tensor([[0.5, 0.5], [0.0, 0.0], [0.0, 0.7], [float("nan")] * 2, [0.3, 0.0]])
    weights = torch.tensor([[0.1, 0.1], [0.1, 0.1], [0.1, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # row 2's only non-zero advantage sits on an untrained token; row 3's NaN must reach the step's guard
    assert rows_without_gradient(g, advantages, weights).tolist() == [False, True, True, False, True]
    with_kl = dataclasses.replace(g, kl_coef=0.1)  # the KL term trains row 1: only untrained rows are left out
    assert rows_without_gradient(with_kl, advantages, weights).tolist() == [False, False, False, False, True]
    off = dataclasses.replace(g, skip_zero_advantage=False)
    assert not rows_without_gradient(off, advantages, weights).any()


def _run_two_updates(rollouts, skip: bool):
    """A real AdamW (weight decay, two PPO epochs): one batch that trains, then one whose rewards are all equal."""
    module, calls = _fresh(skip_zero_advantage=skip, ppo_epochs=2)
    configured = build_optimizer(OptimizerSettings(lr=1e-2, weight_decay=0.1), module.policy.parameters(), [], None, 8)
    opt, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    module.optimizers, module.lr_schedulers = (lambda: opt), (lambda: scheduler)
    stats = []
    for rewards in ([1.0, 0.0, 0.5, 0.0], [0.25] * 4):  # nothing to skip in the first batch: the same weights
        rollouts.rewards = torch.tensor(rewards)
        assign_advantages(rollouts, module.advantage)
        calls.clear()
        stats.append(module.update(rollouts))
    return module, opt, scheduler, calls, stats[-1]


def test_a_step_with_every_turn_skipped_moves_weights_and_moments_as_the_full_passes_do(rollouts):
    full, full_opt, full_sched, full_calls, full_stats = _run_two_updates(rollouts, skip=False)
    skip, opt, sched, calls, stats = _run_two_updates(rollouts, skip=True)
    assert calls == [] and full_calls  # no forward pass at all on the all-equal batch
    assert stats["skipped_rows"] == rollouts.response_ids.shape[0] and stats["micro_batches"] == 0.0
    assert stats["skipped_tokens"] == float(rollouts.response_mask.sum())
    logged = step_metrics(rollouts, stats, 0.0, (1.0, 1.0, 1.0), 2, with_kl=False)
    assert logged["train/skipped_tokens"] == stats["skipped_tokens"] and logged["train/skipped_rows"] > 0
    assert stats["loss"] == full_stats["loss"] == 0.0 and stats["grad_norm"] == full_stats["grad_norm"] == 0.0
    assert sched.last_epoch == full_sched.last_epoch == 4  # two PPO epochs per batch: the schedule advances alike
    for a, b in zip(full.policy.parameters(), skip.policy.parameters()):
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0)  # momentum and weight decay applied alike
    for a, b in zip(full_opt.state.values(), opt.state.values()):
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=0.0, rtol=0.0)


def test_the_update_hands_freed_memory_back_after_each_pass(rollouts, monkeypatch):
    """``allocator.trim`` runs after the old/reference log-probs and after each micro-batch's forward and backward."""
    from lightning_memrl import allocator

    trims = []  # micro_batch flag of each trim (LIGHTNING_MEMRL_MALLOC=phases skips the True ones)
    monkeypatch.setattr(allocator, "trim", lambda micro_batch=False: trims.append(micro_batch))
    _, calls, stats = _grads(rollouts, [1.0, 0.0, 1.0, 0.0], micro_batch_tokens=64)
    passes = int(stats["micro_batches"])
    assert passes >= 2 and len(calls) == passes
    assert trims == [False] + [True] * (2 * passes)
