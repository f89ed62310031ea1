"""Per-turn credit for memory writes, so they are not blamed for failures of the answer turn."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import holds_answer
from lightning_memrl.credit.memory_turns import mix_memory_advantages, require_memory_per_chunk, values_on_rows
from lightning_memrl.types import RolloutBatch, Trajectory


def memory_write_credits(trajectory: Trajectory) -> list[float]:
    """Credit of each memory turn: does the written memory still hold the evidence?

    +1 when the memory holds a gold answer; -1 when a chunk read so far held it but the memory
    does not (the write lost it); 0 when no chunk read so far held it (nothing to keep yet).
    """
    answers = trajectory.task.answers
    credits, seen = [], False
    for chunk, memory in zip(trajectory.chunks, trajectory.memories):
        seen = seen or holds_answer(chunk, answers)
        if holds_answer(memory, answers):
            credits.append(1.0)
        else:
            credits.append(-1.0 if seen else 0.0)
    return credits


class MemoryTokenCredit(MemRLCallback):
    """Mixes a per-turn memory credit into the advantage of memory-writing tokens.

    For tokens of memory turns: ``A = (1 - weight) * A_trajectory + weight * credit``; answer
    turns keep the trajectory advantage. A memory that kept the evidence is reinforced even when
    the answer turn then failed, and one that dropped it is discouraged even when the answer was
    a lucky guess. Turns that are not trained (a frozen agent's) get no credit and take no row.

    Works with workflows whose memory turn ``k`` writes ``trajectory.memories[k]`` after reading
    ``trajectory.chunks[k]`` (``Workflow.memory_per_chunk``: MemAgent); any other workflow (e.g.
    a memory-bank one, whose memory turns are operations) is refused at setup.

    How it differs from HiMPO's :class:`~lightning_memrl.credit.himpo.HindsightMemoryCredit`: this
    credit is a *level* (+1/-1/0: does memory ``k`` hold the answer, given what was read so far),
    so a turn that merely copied a memory already holding the answer gets +1; HiMPO credits the
    *change* a write made (recoverability of ``m_k`` minus that of ``m_{k-1}``) times a bounded
    hindsight relevance, so copying earns 0, and its default weight gives memory tokens the memory
    advantage alone.

    Args:
        weight: share of the memory credit in [0, 1].
    """

    def __init__(self, weight: float = 0.5) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"MemoryTokenCredit: weight must be in [0, 1], got {weight}")
        self.weight = weight
        self.credit_sum = 0.0  # lifetime sums for logging, saved in checkpoints
        self.credited_turns = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow whose memory turns do not each write one memory text after one chunk."""
        require_memory_per_chunk(
            "MemoryTokenCredit",
            getattr(pl_module, "workflow", None),
            "it scores each memory turn by whether the memory it wrote (trajectory.memories[k]) still holds the "
            "gold answer after reading chunk k",
        )

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        values = [memory_write_credits(t) for t in rollouts.trajectories]
        credits = values_on_rows(rollouts, values, "MemoryTokenCredit")
        mix_memory_advantages(rollouts, credits, self.weight)
        batch_credits = credits[rollouts.memory_turns]
        self.credit_sum += float(batch_credits.sum())
        self.credited_turns += batch_credits.numel()
        if batch_credits.numel():  # a batch without memory turns logs nothing
            module.log("train/memory_credit", float(batch_credits.mean()))

    def state_dict(self) -> dict[str, Any]:
        return {"credit_sum": self.credit_sum, "credited_turns": self.credited_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.credit_sum = float(state_dict.get("credit_sum", 0.0))
        self.credited_turns = int(state_dict.get("credited_turns", 0))
