"""StateProgressAdvantage (ReMemR1) on a hand-built batch, against hand-computed advantages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_memrl.credit.state_progress import StateProgressAdvantage, normalise_per_index, recall_gains
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow


def _turn(kind: str, length: int, reward: float = 0.0, trainable: bool = True) -> Turn:
    generation = Generation(list(range(1, length + 1)), torch.zeros(length), False)
    return Turn(kind, [0], generation, reward=reward, trainable=trainable)


class _Log:
    def __init__(self) -> None:
        self.calls: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: object) -> None:
        self.calls[name] = value


def _batch() -> RolloutBatch:
    # one task (gold "Paris France": 2 words), a group of two
    # t0: memories "Paris" (rec 0.5), "Paris France" (rec 1.0), then the answer; reward 1
    # t1: memories "nothing" (rec 0), "France" (rec 0.5), then the answer; reward 0; its first
    #     memory turn carries a format penalty of -0.1 (turn reward)
    task = Task(question="q", context=[], answers=["Paris France"])
    t0 = Trajectory(
        task=task,
        turns=[_turn(MEMORY_TURN, 2), _turn(MEMORY_TURN, 3), _turn(ANSWER_TURN, 1)],
        memories=["Paris", "Paris France"],
    )
    t1 = Trajectory(
        task=task,
        turns=[_turn(MEMORY_TURN, 1, reward=-0.1), _turn(MEMORY_TURN, 2), _turn(ANSWER_TURN, 3)],
        memories=["nothing", "France"],
    )
    batch = RolloutBatch.from_trajectories([t0, t1], group_size=2, pad_id=0)
    batch.rewards = torch.tensor([1.0, 0.0])
    batch.advantages = torch.full((6, 3), 9.0)  # what an estimator left: replaced entirely
    return batch


def test_recall_gains_start_from_the_empty_memory() -> None:
    trajectory = Trajectory(task=Task("q", [], ["Paris France"]), memories=["Paris", "Paris France", "gone"])
    assert recall_gains(trajectory) == [0.5, 0.5, -1.0]


def test_state_progress_advantages_hand_computed() -> None:
    batch = _batch()
    log = _Log()
    StateProgressAdvantage(alpha=0.8, eps=0.0).on_advantages(None, log, batch)  # type: ignore[arg-type]
    # A_out = r - group mean: mean 0.5 -> t0 +0.5, t1 -0.5
    # r_state = r_format + rec(m_k) - rec(m_{k-1}):
    #   t0: k0 0 + 0.5 = 0.5, k1 0 + (1 - 0.5) = 0.5;  t1: k0 -0.1 + 0 = -0.1, k1 0 + 0.5 = 0.5
    # A_state per turn index over the group (unbiased std):
    #   k0: mean 0.2, centred +-0.3, std sqrt(0.18) = 0.4242641 -> +-0.7071068;  k1: equal -> 0
    # answer turns: r_state = their turn reward, 0 for both -> A_state 0
    # A = 0.8 A_out + 0.2 A_state:
    #   t0: 0.4 + 0.1414214 = 0.5414214, 0.4, 0.4;  t1: -0.5414214, -0.4, -0.4
    per_row = torch.tensor([0.5414214, 0.4, 0.4, -0.5414214, -0.4, -0.4])
    torch.testing.assert_close(batch.advantages, per_row.unsqueeze(-1) * batch.response_mask)
    assert batch.advantages[0].tolist() == pytest.approx([0.5414214, 0.5414214, 0.0])  # padding stays 0
    # logs: mean r_state (0.5 + 0.5 - 0.1 + 0.5) / 4 = 0.35; mean gain (0.5 + 0.5 + 0 + 0.5) / 4 = 0.375;
    # mean final recall (1.0 + 0.5) / 2 = 0.75
    assert log.calls == pytest.approx(
        {
            "train/state_progress/state_reward": 0.35,
            "train/state_progress/recall_gain": 0.375,
            "train/state_progress/final_recall": 0.75,
        }
    )


def test_state_progress_alpha_one_is_the_centred_outcome_and_frozen_turns_take_no_row() -> None:
    batch = _batch()
    batch.trajectories[1].turns[0].trainable = False  # t1's first memory turn is frozen: one row fewer
    batch = RolloutBatch.from_trajectories(batch.trajectories, group_size=2, pad_id=0)
    batch.rewards = torch.tensor([1.0, 0.0])
    StateProgressAdvantage(alpha=1.0).on_advantages(None, _Log(), batch)  # type: ignore[arg-type]
    per_row = torch.tensor([0.5, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(batch.advantages, per_row.unsqueeze(-1) * batch.response_mask)


def test_state_progress_answer_turn_format_reward_and_scaled_outcome() -> None:
    batch = _batch()
    batch.trajectories[0].turns[2].reward = 1.0  # t0's answer turn has a format reward of 1
    batch = RolloutBatch.from_trajectories(batch.trajectories, group_size=2, pad_id=0)
    batch.rewards = torch.tensor([1.0, 0.0])
    StateProgressAdvantage(alpha=0.8, eps=0.0, scale_rewards="group").on_advantages(None, _Log(), batch)  # type: ignore[arg-type]
    # A_out scaled by the group std: +-0.5 / sqrt(0.5) = +-0.7071068 -> 0.8 * A_out = +-0.5656854
    # memory k0: +-0.5656854 +- 0.1414214 = +-0.7071068; memory k1: +-0.5656854
    # answers: r_state 1 and 0 -> A_state +-0.7071068 -> +-0.5656854 +- 0.1414214 = +-0.7071068
    per_row = torch.tensor([0.7071068, 0.5656854, 0.7071068, -0.7071068, -0.5656854, -0.7071068])
    torch.testing.assert_close(batch.advantages, per_row.unsqueeze(-1) * batch.response_mask)


def test_normalise_per_index_leaves_lone_and_absent_entries_at_zero() -> None:
    values = torch.tensor([[1.0, 4.0], [3.0, 0.0]], dtype=torch.float64)
    present = torch.tensor([[True, True], [True, False]])
    # column 0: mean 2, centred -1, +1, std sqrt(2) -> -0.7071068, +0.7071068; column 1: one entry -> 0
    out = normalise_per_index(values, present, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-0.7071068, 0.0], [0.7071068, 0.0]], dtype=torch.float64))


def test_state_progress_refuses_a_memory_count_mismatch() -> None:
    batch = _batch()
    batch.trajectories[0].memories.pop()
    with pytest.raises(ValueError, match="trajectory 0 .* 2 memory turns but 1 memories"):
        StateProgressAdvantage().on_advantages(None, _Log(), batch)  # type: ignore[arg-type]


@pytest.mark.parametrize("workflow", [MemoryR1Workflow(), RMMWorkflow()], ids=["memory_r1", "rmm"])
def test_state_progress_refuses_bank_workflows_at_setup(workflow) -> None:
    name = type(workflow).__name__
    with pytest.raises(ConfigError, match=f"cannot serve {name}: .*memory_per_chunk is False"):
        StateProgressAdvantage().setup(None, SimpleNamespace(workflow=workflow), "fit")  # type: ignore[arg-type]
    StateProgressAdvantage().setup(None, SimpleNamespace(workflow=MemAgentWorkflow()), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"alpha": 1.5}, {"alpha": -0.1}, {"eps": -1.0}, {"scale_rewards": "batch"}])
def test_state_progress_bad_options(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="StateProgressAdvantage"):
        StateProgressAdvantage(**kwargs)
