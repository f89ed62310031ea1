"""A user-written reward-shaping callback, composed from YAML.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/memagent/tiny.yaml --config
examples/custom_callbacks.yaml``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_memrl.callbacks import MemRLCallback


class ConciseMemoryBonus(MemRLCallback):
    """Rewards memory turns that use less than ``fraction`` of the memory budget.

    Each such turn adds ``bonus`` to its turn reward (summed into the trajectory reward before
    the group advantage). The count of rewarded turns is saved in checkpoints.

    Args:
        bonus: reward added per concise memory turn.
        fraction: share of ``max_memory_tokens`` below which a memory counts as concise.
    """

    def __init__(self, bonus: float = 0.05, fraction: float = 0.5) -> None:
        self.bonus, self.fraction = bonus, fraction
        self.rewarded_turns = 0

    def on_rewards(self, trainer: Any, module: Any, rollouts: Any) -> None:
        budget = module.workflow.memory.max_memory_tokens
        lengths = rollouts.response_mask.sum(-1)
        concise = rollouts.memory_turns & (lengths < self.fraction * budget)
        rollouts.turn_rewards += torch.where(concise, self.bonus, 0.0)
        self.rewarded_turns += int(concise.sum())

    def state_dict(self) -> dict[str, Any]:
        return {"rewarded_turns": self.rewarded_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rewarded_turns = int(state_dict["rewarded_turns"])
