"""HiMPO's memory-token credit (lightning_memrl.credit.himpo) on hand-built batches."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_memrl.credit.himpo import HindsightMemoryCredit, himpo_terms
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow


class _Log:
    def __init__(self) -> None:
        self.calls: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.calls[name] = value


def _turn(kind: str, length: int) -> Turn:
    return Turn(kind, [0], Generation(list(range(1, length + 1)), torch.zeros(length), False))


def _batch() -> RolloutBatch:
    # trajectory 0 (gold "blue whale"): reads "the sea" -> writes "sea notes" (rec 0), reads "a blue whale swims"
    # -> writes "blue whale" (rec 1), reads "filler" -> writes "whale" (rec 1/2: dropped "blue"), then answers
    t0 = Trajectory(
        task=Task(question="q", context=[], answers=["blue whale"]),
        turns=[_turn(MEMORY_TURN, 2), _turn(MEMORY_TURN, 3), _turn(MEMORY_TURN, 1), _turn(ANSWER_TURN, 2)],
        chunks=["the sea", "a blue whale swims", "filler"],
        memories=["sea notes", "blue whale", "whale"],
    )
    # trajectory 1 (gold "Paris"): the chunk says nothing of Paris, yet the memory says "Paris" (a guess)
    t1 = Trajectory(
        task=Task(question="q", context=[], answers=["Paris"]),
        turns=[_turn(MEMORY_TURN, 2), _turn(ANSWER_TURN, 3)],
        chunks=["nothing here"],
        memories=["Paris"],
    )
    batch = RolloutBatch.from_trajectories([t0, t1], group_size=2, pad_id=0)
    batch.advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -0.5, -0.5]).unsqueeze(-1).expand(6, 3).clone()
    return batch


def test_terms_by_hand() -> None:
    t0, t1 = _batch().trajectories
    # u = rec(m_k) - rec(m_{k-1}) = [0 - 0, 1 - 0, 0.5 - 1]; rec of the chunks = [0, 1, 0]
    assert himpo_terms(t0) == ([0.0, 1.0, -0.5], [0.0, 1.0, 1.0])  # read_so_far: running max of [0, 1, 0]
    assert himpo_terms(t0, hindsight="chunk") == ([0.0, 1.0, -0.5], [0.0, 1.0, 0.0])
    # presence: "whale" alone does not hold "blue whale" -> rec = [0, 1, 0], u = [0, 1, -1]
    assert himpo_terms(t0, recoverability="presence") == ([0.0, 1.0, -1.0], [0.0, 1.0, 1.0])
    assert himpo_terms(t1) == ([1.0], [0.0])  # a gain no chunk supports: relevance 0
    assert himpo_terms(t1, floor=0.2) == ([1.0], [0.2])


def test_memory_tokens_get_the_memory_advantage_alone_by_default() -> None:
    batch, module = _batch(), _Log()
    callback = HindsightMemoryCredit()
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # credits c = u * h: t0 [0*0, 1*1, -0.5*1] = [0, 1, -0.5]; t1 [1*0] = [0]; weight 1: memory tokens = c,
    # padding and answer rows keep the trajectory advantage (0.5 for t0, -0.5 for t1)
    expected = [
        [0.0, 0.0, 0.5],
        [1.0, 1.0, 1.0],
        [-0.5, 0.5, 0.5],
        [0.5, 0.5, 0.5],
        [0.0, 0.0, -0.5],
        [-0.5, -0.5, -0.5],
    ]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected))
    # means over the 4 memory rows: credit (0 + 1 - 0.5 + 0) / 4 = 0.125, utility (0 + 1 - 0.5 + 1) / 4 = 0.375,
    # relevance (0 + 1 + 1 + 0) / 4 = 0.5
    assert module.calls == pytest.approx(
        {"train/himpo/credit": 0.125, "train/himpo/utility": 0.375, "train/himpo/relevance": 0.5}
    )
    assert (callback.credit_sum, callback.credited_turns) == (pytest.approx(0.5), 4)


def test_weight_mixes_and_chunk_hindsight_forgives_a_drop_on_an_irrelevant_chunk() -> None:
    batch = _batch()
    HindsightMemoryCredit(weight=0.5, hindsight="chunk").on_advantages(None, _Log(), batch)  # type: ignore[arg-type]
    # chunk hindsight: c = [0, 1, -0.5 * 0] = [0, 1, 0]; A = 0.5 * 0.5 + 0.5 * c = [0.25, 0.75, 0.25]
    torch.testing.assert_close(batch.advantages[:3, 0], torch.tensor([0.25, 0.75, 0.25]))
    torch.testing.assert_close(batch.advantages[4, :2], torch.tensor([-0.25, -0.25]))  # t1: 0.5 * -0.5 + 0.5 * 0


def test_state_dict_round_trip() -> None:
    callback = HindsightMemoryCredit()
    callback.on_advantages(None, _Log(), _batch())  # type: ignore[arg-type]
    callback.on_advantages(None, _Log(), _batch())  # type: ignore[arg-type]
    assert callback.state_dict() == {"credit_sum": pytest.approx(1.0), "credited_turns": 8}
    restored = HindsightMemoryCredit()
    restored.load_state_dict(callback.state_dict())
    assert (restored.credit_sum, restored.credited_turns) == (pytest.approx(1.0), 8)


@pytest.mark.parametrize("workflow", [MemoryR1Workflow(), Workflow()], ids=["memory_r1", "custom"])
def test_refuses_workflows_without_a_memory_per_chunk_at_setup(workflow: Workflow) -> None:
    message = f"HindsightMemoryCredit cannot serve {type(workflow).__name__}"
    with pytest.raises(ConfigError, match=message):
        HindsightMemoryCredit().setup(None, SimpleNamespace(workflow=workflow), "fit")  # type: ignore[arg-type]
    HindsightMemoryCredit().setup(None, SimpleNamespace(workflow=MemAgentWorkflow()), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weight": 1.5}, "weight must be in"),
        ({"relevance_floor": -0.1}, "relevance_floor must be in"),
        ({"recoverability": "judge"}, "recoverability must be one of"),
        ({"hindsight": "outcome"}, "hindsight must be one of"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HindsightMemoryCredit(**kwargs)
