"""BoundedReward (PAR) on hand-built batches, against hand-computed rewards."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_memrl.credit.bounded_reward import BoundedReward, group_references
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import ANSWER_TURN, Generation, RolloutBatch, Task, Trajectory, Turn

SIG1, SIG2 = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-2))  # 0.7310586, 0.8807971


class _Log:
    def __init__(self) -> None:
        self.calls: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: object) -> None:
        self.calls[name] = value


def _batch(rewards: list[float], group_size: int, turn_rewards: list[float] | None = None) -> RolloutBatch:
    task = Task(question="q", context=[], answers=["x"])
    turns = [Turn(ANSWER_TURN, [0], Generation([1], torch.zeros(1), False)) for _ in rewards]
    batch = RolloutBatch.from_trajectories([Trajectory(task, [t]) for t in turns], group_size, pad_id=0)
    batch.rewards = torch.tensor(rewards)
    if turn_rewards is not None:
        batch.turn_rewards = torch.tensor(turn_rewards)
    return batch


def test_group_references_are_the_other_members() -> None:
    refs = group_references(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2)
    assert refs.tolist() == [[2.0], [1.0], [4.0], [3.0]]


def test_bounded_reward_group_references_hand_computed() -> None:
    # rewards [1, 0, 0.5] and a turn penalty -0.5 on trajectory 2 (e.g. OverlongPenalty): r = [1, 0, 0]
    batch = _batch([1.0, 0.0, 0.5], group_size=3, turn_rewards=[0.0, 0.0, -0.5])
    log = _Log()
    BoundedReward().on_rewards(None, log, batch)  # type: ignore[arg-type]
    # r'0 = (σ(1-0) + σ(1-0)) / 2 = σ(1) = 0.7310586
    # r'1 = (σ(0-1) + σ(0-0)) / 2 = (0.2689414 + 0.5) / 2 = 0.3844707, r'2 the same
    low = (1 - SIG1 + 0.5) / 2
    assert batch.rewards.tolist() == pytest.approx([SIG1, low, low])
    assert batch.turn_rewards.tolist() == [0.0, 0.0, 0.0]  # folded in: not added again after the callbacks
    # raw mean 1/3; bounded mean (0.7310586 + 2 * 0.3844707) / 3 = 0.5
    assert log.calls == pytest.approx({"train/bounded_reward/raw_mean": 1 / 3, "train/bounded_reward/mean": 0.5})


def test_bounded_reward_fixed_references_and_slope() -> None:
    batch = _batch([0.5, 1.0, math.nan], group_size=1)
    BoundedReward(k=2.0, reference_rewards=[0.0, 1.0]).on_rewards(None, _Log(), batch)  # type: ignore[arg-type]
    # r'0 = (σ(2*0.5) + σ(2*-0.5)) / 2 = 0.5;  r'1 = (σ(2*1) + σ(0)) / 2 = (0.8807971 + 0.5) / 2 = 0.6903985
    assert batch.rewards[:2].tolist() == pytest.approx([0.5, (SIG2 + 0.5) / 2])
    assert math.isnan(batch.rewards[2])  # unscored stays unscored


def test_bounded_reward_skips_nan_references() -> None:
    batch = _batch([math.nan, 2.0, 0.0, math.nan, 1.0], group_size=5)
    BoundedReward().on_rewards(None, _Log(), batch)  # type: ignore[arg-type]
    # r'1 = σ(2-0) + σ(2-1) over 2 finite refs = (0.8807971 + 0.7310586) / 2
    # r'2 = (σ(-2) + σ(-1)) / 2;  r'4 = (σ(1-2) + σ(1-0)) / 2 = 0.5
    got = batch.rewards.tolist()
    assert got[1] == pytest.approx((SIG2 + SIG1) / 2)
    assert got[2] == pytest.approx((2 - SIG2 - SIG1) / 2)
    assert got[4] == pytest.approx(0.5)
    assert math.isnan(got[0]) and math.isnan(got[3])
    lone = _batch([math.nan, 3.0], group_size=2)
    BoundedReward().on_rewards(None, _Log(), lone)  # type: ignore[arg-type]
    assert lone.rewards[1].item() == pytest.approx(0.5)  # no finite reference: level


def test_bounded_reward_refuses_group_references_with_groups_of_one() -> None:
    module = SimpleNamespace(grpo=SimpleNamespace(group_size=1))
    with pytest.raises(ConfigError, match="group_size is 1: set group_size >= 2, or give fixed references"):
        BoundedReward().setup(None, module, "fit")  # type: ignore[arg-type]
    BoundedReward(reference_rewards=[0.5]).setup(None, module, "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"k": 0.0}, "init_args.k must be > 0"), ({"reference_rewards": []}, "reference_rewards is empty")],
)
def test_bounded_reward_bad_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BoundedReward(**kwargs)
