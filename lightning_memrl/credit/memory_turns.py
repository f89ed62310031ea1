"""Per-memory-turn plumbing the memory credit methods share: the setup check, rows, mixing, normalising.

A credit method computes one value per memory turn of each trajectory; these helpers find the
``RolloutBatch`` row of each memory turn (trainable turns only take rows), put the values there,
mix them into the advantages of memory-turn tokens, and z-score values within groups.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor

from lightning_memrl.errors import ConfigError
from lightning_memrl.types import MEMORY_TURN, RolloutBatch


def require_memory_per_chunk(method: str, workflow: Any, reads: str, needs_answer_template: bool = False) -> None:
    """Stop at setup unless ``workflow`` writes one memory text per memory turn (``memory_per_chunk``).

    Args:
        method: the class name in the message.
        workflow: the module's workflow (None: nothing to check yet).
        reads: what the method reads of each memory turn, for the message.
        needs_answer_template: the method also fills the workflow's ``answer_template``.

    Raises:
        ConfigError: naming the method and the workflow (e.g. a memory-bank workflow, whose memory
            turns are operations).
    """
    if workflow is None:
        return
    per_chunk = getattr(workflow, "memory_per_chunk", False)
    if not per_chunk or (needs_answer_template and not hasattr(workflow, "answer_template")):
        missing = "memory_per_chunk is False" if not per_chunk else "it has no answer_template"
        raise ConfigError(
            f"{method} cannot serve {type(workflow).__name__}: {reads}, and this workflow records no such memory "
            f"per turn ({missing}; a memory-bank workflow's memory turns are operations). Use it with "
            "MemAgentWorkflow or remove the callback."
        )


def memory_turn_rows(rollouts: RolloutBatch) -> list[list[int | None]]:
    """Per trajectory, the ``RolloutBatch`` row of each memory turn in turn order (None: not trained)."""
    out, row = [], 0
    for trajectory in rollouts.trajectories:
        rows: list[int | None] = []
        for turn in trajectory.turns:
            if turn.kind == MEMORY_TURN:
                rows.append(row if turn.trainable else None)
            row += int(turn.trainable)
        out.append(rows)
    return out


def check_one_memory_per_turn(rollouts: RolloutBatch, method: str) -> None:
    """Raise ``ValueError`` for a trajectory whose memory turns and recorded memories differ in number."""
    for index, (trajectory, rows) in enumerate(zip(rollouts.trajectories, memory_turn_rows(rollouts))):
        if len(rows) != len(trajectory.memories):
            raise ValueError(
                f"{method}: trajectory {index} (task {trajectory.task.id!r}) has {len(rows)} memory turns but "
                f"{len(trajectory.memories)} memories; its workflow must record the memory each memory turn writes"
            )


def values_on_rows(rollouts: RolloutBatch, values: list[list[float]], method: str) -> Tensor:
    """Spread per-memory-turn values onto the batch's rows: ``[M]``, 0.0 on rows of other turns.

    Args:
        rollouts: the step's batch (rows are the trainable turns, in trajectory order).
        values: for each trajectory, one value per memory turn (frozen ones included), in turn order.
        method: the class name in the error message.

    Raises:
        ValueError: a trajectory whose count of values differs from its count of memory turns.
    """
    out = torch.zeros(rollouts.response_ids.shape[0])
    for index, (trajectory, rows, turn_values) in enumerate(
        zip(rollouts.trajectories, memory_turn_rows(rollouts), values)
    ):
        if len(turn_values) != len(rows):
            raise ValueError(
                f"{method}: trajectory {index} (task {trajectory.task.id!r}) has {len(rows)} memory turns "
                f"but {len(turn_values)} values; its workflow must record what each memory turn read and wrote"
            )
        for row, value in zip(rows, turn_values):
            if row is not None:
                out[row] = value
    return out


def mix_memory_advantages(rollouts: RolloutBatch, credits: Tensor, weight: float) -> None:
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


def grouped_zscore(values: Tensor, keys: list[Hashable], eps: float = 1e-6) -> Tensor:
    """``(v - mean) / (std + eps)`` within each set of entries sharing a key, unbiased std as ``GroupRelative``.

    A key held by a single entry gives 0 (nothing to compare with). ``values`` [R], ``keys`` R keys.
    """
    out = torch.zeros_like(values, dtype=torch.float32)
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    for idx in members.values():
        if len(idx) > 1:
            v = values[idx].float()
            out[idx] = (v - v.mean()) / (v.std() + eps)
    return out
