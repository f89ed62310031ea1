"""AdaptiveLengthPenalty (A-DLP) on hand-built batches, against numbers worked out in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from test_rewards_and_callbacks import LogRecorder, turn

from lightning_memrl.credit.adaptive_length import AdaptiveLengthPenalty
from lightning_memrl.errors import ConfigError
from lightning_memrl.rewards import ExactMatch
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, RolloutBatch, Task, Trajectory


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def batch(correct: list[float]) -> RolloutBatch:
    """Four trajectories, each a memory turn of 4 tokens and an answer turn of 3, 5, 2, 6 tokens."""
    task = Task(question="q", context=["c"], answers=["a"])
    trajectories = [Trajectory(task=task, turns=[turn(MEMORY_TURN, 4), turn(ANSWER_TURN, n)]) for n in (3, 5, 2, 6)]
    rollouts = RolloutBatch.from_trajectories(trajectories, group_size=2, pad_id=0)
    rollouts.reward_components = {"exact_match": torch.tensor(correct)}
    return rollouts


def test_weight_rises_with_accuracy_above_the_reference_and_relaxes_below() -> None:
    cb = AdaptiveLengthPenalty(initial_weight=0.01, learning_rate=0.1, reference_accuracy=0.5, turns="answer")
    log = LogRecorder()
    # step 1: λ_0 = 0.01 on the answer rows [3, 5, 2, 6] -> [-0.03, -0.05, -0.02, -0.06], memory rows 0
    #   acc = 3/4 = 0.75 -> λ_1 = 0.01 + 0.1 * (0.75 - 0.5) = 0.035
    first = batch([1.0, 1.0, 1.0, 0.0])
    cb.on_rewards(None, log, first)  # type: ignore[arg-type]
    close(first.turn_rewards, [0.0, -0.03, 0.0, -0.05, 0.0, -0.02, 0.0, -0.06])
    assert cb.weight == pytest.approx(0.035)
    # mean penalty per trajectory: 0.01 * (3 + 5 + 2 + 6) / 4 = 0.04
    assert dict(log.calls) == pytest.approx(
        {
            "train/adaptive_length/weight": 0.01,
            "train/adaptive_length/accuracy": 0.75,
            "train/adaptive_length/penalty": 0.04,
            "train/adaptive_length/reference_accuracy": 0.5,
        }
    )
    # step 2: λ_1 = 0.035 -> [-0.105, -0.175, -0.07, -0.21]; acc 1/4 -> λ_2 = 0.035 + 0.1 * (0.25 - 0.5) = 0.01
    second = batch([0.0, 1.0, 0.0, 0.0])
    cb.on_rewards(None, None, second)  # type: ignore[arg-type]
    close(second.turn_rewards[1::2], [-0.105, -0.175, -0.07, -0.21])
    assert cb.weight == pytest.approx(0.01)
    # step 3: acc 0 -> 0.01 - 0.05 < 0 -> λ_3 = 0 (never negative: no bonus for length)
    cb.on_rewards(None, None, batch([0.0, 0.0, 0.0, 0.0]))  # type: ignore[arg-type]
    assert cb.weight == 0.0
    assert cb.steps == 3


def test_all_turns_unscored_ones_and_a_reference_measured_on_the_first_step() -> None:
    cb = AdaptiveLengthPenalty(initial_weight=0.01, learning_rate=0.1)  # turns all, reference measured
    # step 1: every row penalised: memory 4 -> -0.04; answers -0.03, -0.05, -0.02, -0.06
    #   scored trajectories 0, 1, 3 (2 is NaN): acc = 2/3, which becomes acc_ref: λ_1 = λ_0 = 0.01
    first = batch([1.0, math.nan, 1.0, 0.0])
    cb.on_rewards(None, None, first)  # type: ignore[arg-type]
    close(first.turn_rewards, [-0.04, -0.03, -0.04, -0.05, -0.04, -0.02, -0.04, -0.06])
    assert cb.reference_accuracy == pytest.approx(2 / 3)
    assert cb.weight == pytest.approx(0.01)
    # step 2: acc 1 -> λ_2 = 0.01 + 0.1 * (1 - 2/3) = 0.0433333
    cb.on_rewards(None, None, batch([1.0, 1.0, 1.0, 1.0]))  # type: ignore[arg-type]
    assert cb.weight == pytest.approx(0.0433333, abs=1e-7)
    # a step without any scored trajectory leaves λ unchanged
    cb.on_rewards(None, None, batch([math.nan] * 4))  # type: ignore[arg-type]
    assert cb.weight == pytest.approx(0.0433333, abs=1e-7)


def test_weight_and_reference_survive_a_checkpoint() -> None:
    cb = AdaptiveLengthPenalty(initial_weight=0.01, learning_rate=0.1)
    cb.on_rewards(None, None, batch([1.0, 0.0, 0.0, 0.0]))  # type: ignore[arg-type]  # acc_ref 0.25
    cb.on_rewards(None, None, batch([1.0, 1.0, 1.0, 0.0]))  # type: ignore[arg-type]  # λ = 0.01 + 0.05 = 0.06
    state = cb.state_dict()
    assert state == pytest.approx({"weight": 0.06, "reference_accuracy": 0.25, "steps": 2})
    restored = AdaptiveLengthPenalty(initial_weight=0.01, learning_rate=0.1)
    restored.load_state_dict(state)
    # the next step penalises at 0.06 per token: the first answer row (3 tokens) gets -0.18
    rollouts = batch([1.0, 1.0, 1.0, 0.0])
    restored.on_rewards(None, None, rollouts)  # type: ignore[arg-type]
    assert float(rollouts.turn_rewards[1]) == pytest.approx(-0.18)
    assert (restored.reference_accuracy, restored.steps) == (0.25, 3)


def test_setup_refuses_a_run_without_the_accuracy_reward() -> None:
    class Module:
        reward_functions = [ExactMatch(name="em")]

    with pytest.raises(ConfigError, match=r"accuracy_reward 'exact_match' is not one of this run's reward .*\['em'\]"):
        AdaptiveLengthPenalty().setup(None, Module(), "fit")  # type: ignore[arg-type]
    AdaptiveLengthPenalty(accuracy_reward="em").setup(None, Module(), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_weight": -1.0}, "AdaptiveLengthPenalty.initial_weight must be >= 0.0"),
        ({"learning_rate": -0.1}, "AdaptiveLengthPenalty.learning_rate must be >= 0.0"),
        ({"reference_accuracy": 1.5}, r"AdaptiveLengthPenalty.reference_accuracy must be in \[0.0, 1.0\]"),
        ({"turns": "tool"}, "AdaptiveLengthPenalty.turns must be one of all, answer, memory"),
    ],
)
def test_bad_options_name_the_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AdaptiveLengthPenalty(**kwargs)
