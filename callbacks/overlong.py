"""DAPO's soft overlong punishment, applied per turn."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.types import RolloutBatch


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """0 up to ``max_length - cache_length``, then linear down to -1 at ``max_length``, -1 beyond.

    Args:
        lengths: response lengths in tokens, any shape.
        max_length: DAPO's ``L_max``.
        cache_length: DAPO's ``L_cache`` (the soft buffer).
    """
    soft_start = max_length - cache_length
    inside = (soft_start - lengths.float()) / cache_length
    penalty = torch.where(lengths <= soft_start, torch.zeros_like(inside), inside)
    return penalty.clamp(min=-1.0)


class OverlongPenalty(MemRLCallback):
    """Adds DAPO's soft overlong penalty of each turn to that turn's reward.

    Args:
        max_length: length at which the penalty reaches -1 (usually the turn's generation cap).
        cache_length: width of the soft buffer before ``max_length``.
        weight: multiplies the penalty.
        turns: ``all`` turns, only ``answer`` turns, or only ``memory`` turns.
    """

    def __init__(self, max_length: int, cache_length: int, weight: float = 1.0, turns: str = "all") -> None:
        if not 0 < cache_length <= max_length:
            raise ValueError(f"OverlongPenalty: need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
        if turns not in ("all", "answer", "memory"):
            raise ValueError(f"OverlongPenalty: turns must be 'all', 'answer' or 'memory', got {turns!r}")
        self.max_length, self.cache_length, self.weight, self.turns = max_length, cache_length, weight, turns
        self.penalised_turns = 0  # lifetime count, saved in checkpoints

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        lengths = rollouts.response_mask.sum(-1)
        penalty = soft_overlong_penalty(lengths, self.max_length, self.cache_length) * self.weight
        if self.turns == "answer":
            penalty = penalty * (~rollouts.memory_turns)
        elif self.turns == "memory":
            penalty = penalty * rollouts.memory_turns
        rollouts.turn_rewards += penalty
        self.penalised_turns += int((penalty < 0).sum())

    def state_dict(self) -> dict[str, Any]:
        return {"penalised_turns": self.penalised_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.penalised_turns = int(state_dict.get("penalised_turns", 0))
