"""MemoryTokenCredit beyond plain MemAgent (frozen turns, bank workflows), and a rank without trainable turns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_memrl.callbacks import MemoryTokenCredit
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

TESTS = Path(__file__).resolve().parent


def _turn(kind: str, length: int, trainable: bool = True) -> Turn:
    generation = Generation(list(range(1, length + 1)), torch.zeros(length), False)
    return Turn(kind, [0], generation, trainable=trainable)


class _Log:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def log(self, name: str, value: float) -> None:
        self.calls.append((name, value))


def test_memory_credit_skips_frozen_turns_and_credits_the_trainable_rows():
    # trajectory 0 (answer Paris): a frozen memory turn (kept the answer: +1, no row), a trainable one
    # that lost it (-1), the answer; trajectory 1 (Rome): a trainable memory turn (+1), a frozen answer
    t0 = Trajectory(
        task=Task(question="q0", context=[], answers=["Paris"]),
        turns=[_turn(MEMORY_TURN, 2, trainable=False), _turn(MEMORY_TURN, 2), _turn(ANSWER_TURN, 2)],
        chunks=["Paris is nice", "filler"],
        memories=["Paris", "forgot"],
    )
    t1 = Trajectory(
        task=Task(question="q1", context=[], answers=["Rome"]),
        turns=[_turn(MEMORY_TURN, 1), _turn(ANSWER_TURN, 2, trainable=False)],
        chunks=["Rome"],
        memories=["Rome"],
    )
    batch = RolloutBatch.from_trajectories([t0, t1], group_size=1, pad_id=0)
    assert batch.response_ids.shape[0] == 3  # rows: t0 memory 2, t0 answer, t1 memory
    batch.advantages = torch.tensor([[2.0, 2.0], [2.0, 2.0], [-1.0, -1.0]])
    module = _Log()
    callback = MemoryTokenCredit(weight=0.5)
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # row 0: 0.5*2 + 0.5*(-1) = 0.5; row 1: answer, unchanged; row 2: 0.5*(-1) + 0.5*1 = 0 on 1 token
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.5, 0.5], [2.0, 2.0], [0.0, -1.0]]))
    assert (callback.credited_turns, callback.credit_sum) == (2, 0.0)
    assert module.calls == [("train/memory_credit", 0.0)]


@pytest.mark.parametrize("workflow", [MemoryR1Workflow(), RMMWorkflow()], ids=["memory_r1", "rmm"])
def test_memory_credit_refuses_bank_workflows_at_setup(workflow):
    name = type(workflow).__name__
    with pytest.raises(ConfigError, match=f"cannot serve {name}: .*memory_per_chunk is False"):
        MemoryTokenCredit().setup(None, SimpleNamespace(workflow=workflow), "fit")  # type: ignore[arg-type]
    MemoryTokenCredit().setup(None, SimpleNamespace(workflow=MemAgentWorkflow()), "fit")  # type: ignore[arg-type]


def test_memory_credit_names_a_trajectory_without_recorded_memories():
    bank_like = Trajectory(  # a manager's operations: memory turns, but no (chunk, memory) pairs
        task=Task(question="q", context=[], answers=["a"], id="conv:qa0"),
        turns=[_turn(MEMORY_TURN, 1), _turn(MEMORY_TURN, 1), _turn(ANSWER_TURN, 1, trainable=False)],
    )
    batch = RolloutBatch.from_trajectories([bank_like], group_size=1, pad_id=0)
    batch.advantages = torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"trajectory 0 \(task 'conv:qa0'\) has 2 memory turns but 0"):
        MemoryTokenCredit().on_advantages(None, _Log(), batch)  # type: ignore[arg-type]


def test_a_rank_without_trainable_turns_stays_in_step_with_the_others(tmp_path):
    """Two CPU processes over gloo: rank 1's turns are all frozen, rank 0 trains; both finish 2 steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "empty_rank_worker.py"), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[1]["turns"] == [0, 0] and all(n > 0 for n in ranks[0]["turns"])
    assert [r["global_step"] for r in ranks] == [2, 2]
    end = ranks[0]["end"]
    assert any(not torch.equal(end[k], ranks[0]["initial"][k]) for k in end)  # rank 0's turns trained the policy
    for name, value in end.items():  # one model: rank 1 applied the same update
        torch.testing.assert_close(ranks[1]["end"][name], value, rtol=0, atol=0)
    for step in range(2):  # the same keys on both ranks (synced), all finite
        assert ranks[0]["logged"][step] == ranks[1]["logged"][step]
        assert all(torch.isfinite(torch.tensor(v)) for v in ranks[0]["logged"][step].values())
