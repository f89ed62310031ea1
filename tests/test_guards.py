"""Non-finite rewards, losses and checkpoints: they are counted and kept out of the weights."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
from helpers import quiet_trainer

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
    losses,
)
from lightning_memrl.advantages import GroupRelative
from lightning_memrl.callbacks import MemRLCallback
from lightning_memrl.errors import MemRLError
from lightning_memrl.guards import NonFiniteTrainingError, RewardValueError, SkipCounter, reward_value
from lightning_memrl.rewards import RewardFunction


class Scripted(RewardFunction):
    """Returns ``values[k % len(values)]`` on its k-th call (one call per trajectory, in order)."""

    default_name = "scripted"

    def __init__(self, values: list, name: str | None = None) -> None:
        super().__init__(name=name)
        self.values, self.calls = values, 0

    def score_answer(self, completion: str, answers: list[str]):
        value = self.values[self.calls % len(self.values)]
        self.calls += 1
        return value


class Advantages(MemRLCallback):
    """Records each step's rewards and trajectory advantages."""

    def __init__(self) -> None:
        self.rewards, self.advantages = [], []

    def on_advantages(self, trainer, module, rollouts):
        self.rewards.append(rollouts.rewards.clone())
        self.advantages.append(rollouts.trajectory_advantages.clone())


def _module(rewards, group_size=4, **grpo):
    return MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=rewards,
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=group_size, **grpo),
        optimizer=OptimizerSettings(lr=1e-3),
    )


def _data():
    return MemRLDataModule(
        batch_size=1,
        synthetic=SyntheticTaskSettings(num_tasks=4, min_chunks=1, max_chunks=1, sentences_per_chunk=1),
        synthetic_val=SyntheticTaskSettings(num_tasks=2, seed=99, min_chunks=1, max_chunks=1, sentences_per_chunk=1),
    )


def _finite_everywhere(module, trainer) -> bool:
    params = all(bool(torch.isfinite(p).all()) for p in module.policy.parameters())
    moments = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
    return params and all(bool(torch.isfinite(v).all()) for v in moments)


def test_infinite_rewards_are_left_out_counted_and_keep_weights_finite(tmp_path):
    # per step (group of 4): +inf, 1, -inf, 3 -> the two finite rewards form the baseline
    recorder = Advantages()
    module = _module([Scripted([math.inf, 1.0, -math.inf, 3.0])])
    trainer = quiet_trainer(tmp_path, steps=2, callbacks=[recorder])
    trainer.fit(module, _data())
    assert trainer.global_step == 2
    assert _finite_everywhere(module, trainer)  # main: every weight and AdamW moment NaN
    assert trainer.logged_metrics["train/nonfinite_rewards"] == 2.0
    assert trainer.logged_metrics["train/frac_reward_nan"] == 0.5
    assert trainer.logged_metrics["train/skipped_steps"] == 0.0
    # valid rewards 1 and 3: mean 2, unbiased std sqrt(2) -> -+1/sqrt(2); the infinite ones 0
    expected = torch.tensor([0.0, -1.0, 0.0, 1.0]) / (math.sqrt(2) + 1e-4)
    expected[[0, 2]] = 0.0
    for rewards, advantages in zip(recorder.rewards, recorder.advantages):
        assert torch.isnan(rewards[[0, 2]]).all()
        torch.testing.assert_close(advantages, expected)


def test_huge_rewards_keep_their_advantages():
    # [1e30, -1e30, 1e30, -1e30]: mean 0, unbiased var 4e60/3, std 1.1547e30 -> +-0.8660254
    # float32 statistics overflow (1e60 > 3.4e38) and gave 0 for every trajectory
    rewards = torch.tensor([1e30, -1e30, 1e30, -1e30])
    expected = torch.tensor([1.0, -1.0, 1.0, -1.0]) * math.sqrt(3) / 2
    torch.testing.assert_close(GroupRelative("group").from_rewards(rewards, 4), expected)
    torch.testing.assert_close(GroupRelative("batch").from_rewards(rewards, 4), expected)
    # groups [1e30, 3e30], [2e30, 2e30]: batch std of (1, 3, 2, 2)e30 = sqrt(2/3)e30
    batch = GroupRelative("batch").from_rewards(torch.tensor([1e30, 3e30, 2e30, 2e30]), 2)
    torch.testing.assert_close(batch, torch.tensor([-1.0, 1.0, 0.0, 0.0]) / math.sqrt(2 / 3))
    torch.testing.assert_close(GroupRelative("none").from_rewards(rewards, 2), torch.tensor([1e30, -1e30, 1e30, -1e30]))


def test_infinite_reward_is_left_out_of_the_group_statistics():
    adv = GroupRelative("group", eps=0.0).from_rewards(torch.tensor([math.inf, 1.0, -math.inf, 3.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.0, 0.0, 1.0]) / math.sqrt(2))


@pytest.mark.parametrize(
    ("value", "shown"),
    [("0.5", "a str ('0.5')"), ([0.5, 0.5], "2 values"), (torch.tensor([1.0, 2.0]), "a Tensor"), (1j, "a complex")],
)
def test_reward_that_is_not_a_number_stops_naming_the_function(tmp_path, value, shown):
    module = _module([Scripted([1.0]), Scripted([value], name="my_reward")])
    message = re.escape(f"reward function 'my_reward' (Scripted) returned {shown}")
    with pytest.raises(RewardValueError, match=message) as err:
        quiet_trainer(tmp_path, steps=1).fit(module, _data())
    assert isinstance(err.value, MemRLError)  # the command line prints it without a traceback


def test_reward_value_accepts_numbers_and_none():
    assert reward_value(None, "f") is None
    assert reward_value(True, "f") == 1.0 and reward_value(3, "f") == 3.0
    assert reward_value(torch.tensor(0.25), "f") == 0.25
    assert math.isinf(reward_value(float("inf"), "f"))  # kept: the caller counts it and leaves it out


def test_all_nan_rewards_warn_and_are_measured(tmp_path, caplog):
    module = _module([Scripted([math.nan, None])])
    trainer = quiet_trainer(tmp_path, steps=2)
    with caplog.at_level(logging.WARNING, logger="lightning_memrl.guards"):
        trainer.fit(module, _data())
    warnings = [r for r in caplog.records if "every reward is NaN" in r.getMessage()]
    assert len(warnings) == 2  # once per step
    assert "4 trajectories, 2 of them non-finite" in warnings[0].getMessage()
    assert trainer.logged_metrics["train/frac_reward_nan"] == 1.0
    assert trainer.logged_metrics["train/nonfinite_rewards"] == 2.0


def _nan_loss(monkeypatch, module, steps_with_nan):
    """Make the loss NaN on the optimizer steps (0-based) in ``steps_with_nan``."""
    original = losses.policy_loss

    def policy_loss(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return (loss * math.nan, stats) if module.global_step in steps_with_nan else (loss, stats)

    monkeypatch.setattr(losses, "policy_loss", policy_loss)


class Metrics(MemRLCallback):
    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_nan_loss_skips_the_step_and_counts_it(tmp_path, monkeypatch):
    module, metrics = _module([Scripted([0.0, 1.0, 2.0, 5.0])]), Metrics()
    module.configure_model()
    _nan_loss(monkeypatch, module, {1})
    snapshots = []

    class Snapshot(MemRLCallback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            snapshots.append({n: p.detach().clone() for n, p in module.policy.named_parameters()})

    trainer = quiet_trainer(tmp_path, steps=3, callbacks=[metrics, Snapshot()])
    trainer.fit(module, _data())
    assert trainer.global_step == 3  # a skipped step still counts toward max_steps
    assert [r["train/skipped_steps"] for r in metrics.rows] == [0.0, 1.0, 0.0]
    assert all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])  # step 2 changed nothing
    assert any(not torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[0])  # step 3 trained
    assert _finite_everywhere(module, trainer)
    adam_steps = {float(s["step"]) for s in trainer.optimizers[0].state.values()}
    assert adam_steps == {2.0}  # AdamW's bias correction counts applied updates only
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # the schedule follows global_step


def test_consecutive_skipped_steps_stop_the_run(tmp_path, monkeypatch):
    module = _module([Scripted([0.0, 1.0, 2.0, 5.0])], max_consecutive_skipped_steps=2)
    module.configure_model()
    _nan_loss(monkeypatch, module, {1, 2, 3, 4})
    trainer = quiet_trainer(tmp_path, steps=6)
    with pytest.raises(NonFiniteTrainingError, match="2 optimizer steps in a row were skipped") as err:
        trainer.fit(module, _data())
    assert "max_consecutive_skipped_steps" in str(err.value) and "loss=nan" in str(err.value)
    assert trainer.global_step == 2  # steps 0 (trained) and 1 (skipped); the second skip stops
    assert all(bool(torch.isfinite(p).all()) for p in module.policy.parameters())


def test_skip_counter_resets_after_a_good_step():
    counter = SkipCounter(max_consecutive=2)
    for skipped in (True, False, True, False):
        counter.record(skipped, "loss=nan")
    assert counter.total == 2 and counter.consecutive == 0
    counter.record(True, "loss=nan")
    with pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row .*last: loss=inf"):
        counter.record(True, "loss=inf")


def test_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    module = _module([Scripted([0.0, 1.0, 2.0, 5.0])])
    trainer = quiet_trainer(tmp_path, steps=1)
    trainer.fit(module, _data())
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    with torch.no_grad():
        next(module.policy.parameters())[0, 0] = math.nan
    with pytest.raises(NonFiniteTrainingError, match=r"refusing to save a checkpoint at step 1: 2 weight") as err:
        trainer.save_checkpoint(tmp_path / "bad.ckpt")  # 2: the tiny model ties embedding and LM head
    assert "policy.model.embed_tokens.weight (1)" in str(err.value)
    assert not (tmp_path / "bad.ckpt").exists() and (tmp_path / "good.ckpt").exists()
