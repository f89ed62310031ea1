"""Per-turn credit for memory writes, so they are not blamed for failures of the answer turn."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import holds_answer
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import MEMORY_TURN, RolloutBatch, Trajectory


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
        workflow = getattr(pl_module, "workflow", None)
        if workflow is not None and not getattr(workflow, "memory_per_chunk", False):
            raise ConfigError(
                f"MemoryTokenCredit cannot credit the memory turns of {type(workflow).__name__}: it scores each "
                "memory turn by whether the memory it wrote (trajectory.memories[k]) still holds the gold answer "
                "after reading chunk k, and this workflow records no such memory per turn (memory_per_chunk is "
                "False; a memory-bank workflow's memory turns are operations). Remove the callback for this workflow."
            )

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        credits = torch.zeros(rollouts.response_ids.shape[0])
        row = 0  # rows are the trainable turns, in trajectory order
        for index, trajectory in enumerate(rollouts.trajectories):
            memory_turns = [t for t in trajectory.turns if t.kind == MEMORY_TURN]
            memory_credits = memory_write_credits(trajectory)
            if len(memory_credits) != len(memory_turns):
                raise ValueError(
                    f"MemoryTokenCredit: trajectory {index} (task {trajectory.task.id!r}) has {len(memory_turns)} "
                    f"memory turns but {len(memory_credits)} (chunk, memory) pairs; its workflow must record the "
                    "chunk read and the memory written by each memory turn"
                )
            credit_of = iter(memory_credits)
            for turn in trajectory.turns:
                credit = next(credit_of) if turn.kind == MEMORY_TURN else 0.0
                if turn.trainable:
                    credits[row] = credit
                    row += 1
        is_memory = rollouts.memory_turns.unsqueeze(-1)  # [M, 1]
        mixed = (1 - self.weight) * rollouts.advantages + self.weight * credits.unsqueeze(-1)
        mask = rollouts.response_mask.bool()
        rollouts.advantages = torch.where(is_memory & mask, mixed, rollouts.advantages)
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
