"""The callback protocol ``MemRLModule`` calls during each training step.

``MemRLModule.training_step`` calls, for every callback in ``trainer.callbacks`` that is a
``MemRLCallback`` and in that order:

1. ``on_rewards(trainer, module, rollouts)`` after the reward functions scored the batch and
   before advantages exist. Change ``rollouts.rewards`` (``[N]``, one per trajectory) or
   ``rollouts.turn_rewards`` (``[M]``, one per turn; the module sums them into their trajectory's
   reward before the group advantage).
2. ``on_advantages(trainer, module, rollouts)`` after each trajectory's advantage was broadcast
   to its tokens. Change ``rollouts.advantages`` (``[M, T]``).

Each callback sees what the previous one left, so order in the YAML list is order of effect.
State that must survive a resume goes in ``state_dict``/``load_state_dict`` (Lightning saves it
under ``state_key``).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_memrl.types import RolloutBatch


class MemRLCallback(L.Callback):
    """Base of callbacks that shape rewards or attribute credit inside ``training_step``."""

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        """Change per-trajectory or per-turn rewards in place."""

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        """Change per-token advantages in place."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
