"""CompressionReward (Mem-α's shaping terms) on hand-built trajectories, against hand-computed scores."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl.credit.compression import CompressionReward, valid_operation_fraction
from lightning_memrl.learner import score_trajectories
from lightning_memrl.rewards import ExactMatch
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn


def _turn(kind: str, text: str = "") -> Turn:
    return Turn(kind, [0], Generation([1], torch.zeros(1), False), text=text)


def _memagent(memories: list[str], info: dict | None = None) -> Trajectory:
    # two chunks of 5 words: |context| = 10 words
    return Trajectory(
        task=Task(question="q", context=[], answers=["Paris"], id="t0"),
        turns=[_turn(MEMORY_TURN) for _ in memories] + [_turn(ANSWER_TURN, "\\boxed{Paris}")],
        chunks=["a b c d e", "f g h i j"],
        memories=memories,
        info=dict(info or {}),
    )


def test_compression_reward_memagent_hand_computed() -> None:
    trajectory = _memagent(["a b", "x y z w"])
    # final memory 4 words of a 10-word context: 1 - 4/10 = 0.6; every memory turn a valid write: 1.0
    # 0.05 * 0.6 + 1.0 * 1.0 = 1.03
    assert CompressionReward().score(trajectory) == pytest.approx(1.03)
    # w_c 0.5, w_f 0.2: 0.5 * 0.6 + 0.2 * 1.0 = 0.5
    assert CompressionReward(compression_weight=0.5, format_weight=0.2).score(trajectory) == pytest.approx(0.5)


def test_compression_reward_reads_recorded_operation_counts_and_is_not_clipped() -> None:
    trajectory = _memagent(["one two three four five six seven eight nine ten eleven twelve"])
    trajectory.info.update(memory_operations=4, valid_memory_operations=3)
    # 12 memory words of 10 context words: 1 - 1.2 = -0.2; 3 of 4 operations valid: 0.75
    # 0.05 * -0.2 + 1.0 * 0.75 = 0.74
    assert CompressionReward().score(trajectory) == pytest.approx(0.74)
    trajectory.info.update(memory_operations=0, valid_memory_operations=0)
    assert valid_operation_fraction(trajectory) == 0.0


def test_compression_reward_stacks_with_exact_match() -> None:
    batch = RolloutBatch.from_trajectories([_memagent(["a b", "x y z w"])], group_size=1, pad_id=0)
    total, components, _ = score_trajectories([ExactMatch(), CompressionReward(weight=2.0)], batch)
    # exact match 1 + 2 * 1.03 = 3.06; the component is logged unweighted
    assert total.tolist() == pytest.approx([3.06])
    assert components["compression"].tolist() == pytest.approx([1.03])


def test_compression_reward_leaves_an_empty_context_unscored() -> None:
    trajectory = _memagent(["a"])
    trajectory.chunks = ["", "  "]
    assert CompressionReward().score(trajectory) is None


def test_compression_reward_refuses_a_trajectory_without_memory_text() -> None:
    bank_like = Trajectory(task=Task(question="q", context=[], answers=["x"], id="conv-3:q7"), chunks=["a b"])
    with pytest.raises(ValueError, match=r"'conv-3:q7' records no memory text .*MemAgentWorkflow"):
        CompressionReward().score(bank_like)
