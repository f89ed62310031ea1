"""A user subclass of MemRLModule that overrides how advantages are computed.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/tiny.yaml
--model.class_path custom_advantages.RankAdvantageModule``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_memrl import MemRLModule, RolloutBatch


class RankAdvantageModule(MemRLModule):
    """Advantages from reward ranks within each group, centred to mean 0 and scaled to [-1, 1].

    Rank-based advantages ignore the scale of rewards, which helps when reward functions with
    different ranges are mixed. NaN rewards get advantage 0.
    """

    def compute_advantages(self, rollouts: RolloutBatch) -> Tensor:
        groups = rollouts.rewards.view(-1, rollouts.group_size)  # [N/G, G]
        out = torch.zeros_like(groups)
        for row, rewards in enumerate(groups):
            valid = ~torch.isnan(rewards)
            if valid.sum() < 2:
                continue
            ranks = rewards[valid].argsort().argsort().float()  # ties keep index order
            out[row, valid] = ranks / (valid.sum() - 1) * 2 - 1
        return out.view(-1)
