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


def require_memory_per_chunk(pl_module: L.LightningModule, method: str, why: str) -> None:
    """Raise :class:`ConfigError` when ``pl_module.workflow`` does not write one memory per chunk.

    Args:
        pl_module: the module being set up (its ``workflow`` is checked when it has one).
        method: the class name in the message.
        why: what the method reads of each memory turn, for the message.
    """
    workflow = getattr(pl_module, "workflow", None)
    if workflow is not None and not getattr(workflow, "memory_per_chunk", False):
        raise ConfigError(
            f"{method} cannot credit the memory turns of {type(workflow).__name__}: {why}, and this workflow "
            "records no such memory per turn (memory_per_chunk is False; a memory-bank workflow's memory turns "
            "are operations). Remove the callback for this workflow."
        )


def memory_turn_rows(rollouts: RolloutBatch, values: list[list[float]], method: str) -> torch.Tensor:
    """Spread per-memory-turn values onto the batch's rows: ``[M]``, 0.0 on rows of other turns.

    Args:
        rollouts: the step's batch (rows are the trainable turns, in trajectory order).
        values: for each trajectory, one value per memory turn (frozen ones included), in turn order.
        method: the class name in the error message.

    Raises:
        ValueError: a trajectory whose count of values differs from its count of memory turns.
    """
    rows = torch.zeros(rollouts.response_ids.shape[0])
    row = 0
    for index, (trajectory, turn_values) in enumerate(zip(rollouts.trajectories, values)):
        memory_turns = [t for t in trajectory.turns if t.kind == MEMORY_TURN]
        if len(turn_values) != len(memory_turns):
            raise ValueError(
                f"{method}: trajectory {index} (task {trajectory.task.id!r}) has {len(memory_turns)} memory turns "
                f"but {len(turn_values)} (chunk, memory) pairs; its workflow must record the chunk read and the "
                "memory written by each memory turn"
            )
        value_of = iter(turn_values)
        for turn in trajectory.turns:
            value = next(value_of) if turn.kind == MEMORY_TURN else 0.0
            if turn.trainable:
                rows[row] = value
                row += 1
    return rows


def mix_memory_advantages(rollouts: RolloutBatch, credits: torch.Tensor, weight: float) -> None:
    """On generated tokens of memory turns: ``A = (1 - weight) * A + weight * credit``; other tokens keep ``A``.

    Args:
        rollouts: the batch whose ``advantages`` (``[M, T]``) change in place.
        credits: ``[M]``, one credit per row.
        weight: share of the credit, in [0, 1].
    """
    is_memory = rollouts.memory_turns.unsqueeze(-1)  # [M, 1]
    mixed = (1 - weight) * rollouts.advantages + weight * credits.unsqueeze(-1)
    mask = rollouts.response_mask.bool()
    rollouts.advantages = torch.where(is_memory & mask, mixed, rollouts.advantages)


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
            pl_module,
            "MemoryTokenCredit",
            "it scores each memory turn by whether the memory it wrote (trajectory.memories[k]) still holds the "
            "gold answer after reading chunk k",
        )

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        values = [memory_write_credits(t) for t in rollouts.trajectories]
        credits = memory_turn_rows(rollouts, values, "MemoryTokenCredit")
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
