"""Per-turn credit for memory writes, so they are not blamed for failures of the answer turn."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning_memrl.callbacks.base import MemRLCallback

from lightning_memrl.rewards import normalize_answer

if TYPE_CHECKING:
    from lightning_memrl.workflow import RolloutBatch, Trajectory


def memory_write_credits(trajectory: Trajectory) -> list[float]:
    """Credit of each memory turn: does the written memory still hold the evidence?

    +1 when the memory holds a gold answer; -1 when a chunk read so far held it but the memory
    does not (the write lost it); 0 when no chunk read so far held it (nothing to keep yet).
    """
    answers = [f" {a} " for a in map(normalize_answer, trajectory.task.answers) if a]

    def holds(text: str) -> bool:  # whole-word match: "10" is not found in "100"
        return any(a in f" {normalize_answer(text)} " for a in answers)

    credits, seen = [], False
    for chunk, memory in zip(trajectory.chunks, trajectory.memories):
        seen = seen or holds(chunk)
        if holds(memory):
            credits.append(1.0)
        else:
            credits.append(-1.0 if seen else 0.0)
    return credits


class MemoryTokenCredit(MemRLCallback):
    """Mixes a per-turn memory credit into the advantage of memory-writing tokens.

    For tokens of memory turns: ``A = (1 - weight) * A_trajectory + weight * credit``; answer
    turns keep the trajectory advantage. A memory that kept the evidence is reinforced even when
    the answer turn then failed, and one that dropped it is discouraged even when the answer was
    a lucky guess.

    Args:
        weight: share of the memory credit in [0, 1].
    """

    def __init__(self, weight: float = 0.5) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"MemoryTokenCredit: weight must be in [0, 1], got {weight}")
        self.weight = weight
        self.credit_sum = 0.0  # lifetime sums for logging, saved in checkpoints
        self.credited_turns = 0

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        credits = torch.zeros(rollouts.response_ids.shape[0])
        row = 0
        for trajectory in rollouts.trajectories:
            memory_credits = iter(memory_write_credits(trajectory))
            for _turn in trajectory.turns:
                if rollouts.memory_tokens_mask[row]:
                    credits[row] = next(memory_credits)
                row += 1
        is_memory = rollouts.memory_tokens_mask.unsqueeze(-1)  # [M, 1]
        mixed = (1 - self.weight) * rollouts.advantages + self.weight * credits.unsqueeze(-1)
        mask = rollouts.response_mask.bool()
        rollouts.advantages = torch.where(is_memory & mask, mixed, rollouts.advantages)
        batch_credits = credits[rollouts.memory_tokens_mask]
        self.credit_sum += float(batch_credits.sum())
        self.credited_turns += batch_credits.numel()
        if batch_credits.numel():  # a batch without memory turns logs nothing
            module.log("train/memory_credit", float(batch_credits.mean()))

    def state_dict(self) -> dict[str, Any]:
        return {"credit_sum": self.credit_sum, "credited_turns": self.credited_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.credit_sum = float(state_dict.get("credit_sum", 0.0))
        self.credited_turns = int(state_dict.get("credited_turns", 0))
