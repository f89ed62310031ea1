"""A user-written advantage estimator (RLOO), chosen from YAML by class path.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/memagent/tiny.yaml --config
examples/custom_advantages.yaml``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_memrl.advantages import AdvantageEstimator, grouped_rewards


class RLOO(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

    Each trajectory's baseline is the mean reward of the *other* members of its group:
    ``A_i = r_i - mean_{j != i} r_j = r_i - (sum_j r_j - r_i) / (k - 1)``, over the ``k`` valid
    (finite) rewards of the group; no division by a std. A NaN reward gets advantage 0 and is left
    out of the others' baselines; a group with fewer than two valid rewards gets 0 everywhere.
    """

    def from_rewards(self, rewards: Tensor, group_size: int) -> Tensor:  # [N] -> [N] float32
        filled, valid = grouped_rewards(rewards, group_size)  # [N/G, G] float64, NaN set to 0
        count = valid.sum(-1, keepdim=True)  # [N/G, 1] valid rewards per group
        others = (filled.sum(-1, keepdim=True) - filled) / (count - 1).clamp(min=1)  # mean of the others
        advantages = torch.where(valid & (count > 1), filled - others, torch.zeros_like(filled))
        return advantages.view(-1).float()
