"""Bounded reward: PAR, "Preference As Reward" (Fu et al. 2025, Reward Shaping to Mitigate Reward Hacking in RLHF,
arXiv:2502.18770).

PAR replaces a reward ``r`` by the mean sigmoid of its margin over reference rewards,
``r' = (1/M) Σ_m σ(r − r_ref,m)``: bounded in (0, 1), steep near the references and flat far from
them, so a reward that runs away (a hacked reward model, a shaping term that grows without end)
stops pulling the policy. In the paper the references are the rewards of responses the reference
(SFT) model gave to the same prompt, and a single one already works.
"""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.types import RolloutBatch

_OPTION = "trainer.callbacks[BoundedReward].init_args."


def group_references(rewards: Tensor, group_size: int) -> Tensor:  # [N] -> [N, G - 1]
    """For every trajectory, the rewards of the other members of its group (NaN stays NaN)."""
    groups = rewards.view(-1, group_size)  # [N/G, G]
    others = [torch.cat([groups[:, :i], groups[:, i + 1 :]], dim=1) for i in range(group_size)]
    return torch.stack(others, dim=1).reshape(rewards.numel(), group_size - 1)


def bounded_rewards(rewards: Tensor, references: Tensor, k: float) -> Tensor:  # [N], [N, R] -> [N]
    """``mean_m σ(k·(r − ref_m))`` over the finite references of each row.

    A row without a finite reference gets ``σ(0) = 0.5`` (level with what it is compared to); a NaN
    reward stays NaN (unscored).
    """
    valid = torch.isfinite(references)
    margins = torch.sigmoid(k * (rewards.unsqueeze(-1) - torch.where(valid, references, 0.0)))
    count = valid.sum(-1)
    mean = torch.where(valid, margins, 0.0).sum(-1) / count.clamp(min=1)
    mean = torch.where(count > 0, mean, torch.full_like(mean, 0.5))
    return torch.where(torch.isnan(rewards), rewards, mean)


class BoundedReward(MemRLCallback):
    """PAR's bounded reward (arXiv:2502.18770), applied to each trajectory's reward in ``on_rewards``.

    As implemented: ``r'_i = (1/M) Σ_m σ(k·(r_i − r_ref,m))``, where ``r_i`` is trajectory ``i``'s
    whole reward (the reward functions' weighted sum plus its turn rewards, which are folded in here
    and then zeroed, so the result stays in (0, 1)), ``σ`` the logistic function and the references:

    - ``reference_rewards`` given: those fixed values for every trajectory (e.g. ``[0.5]`` for a 0/1
      exact-match reward, or the mean reward of the starting model);
    - ``reference_rewards: null`` (default): the other ``G − 1`` members of its group, whose
      responses to the same prompt stand in for the paper's reference-model responses (rollouts
      here come from the policy, the only model sampled on-line). Needs ``group_size >= 2``.

    ``k = 1`` is the paper's formula; a larger ``k`` sharpens the step around the references. NaN
    rewards stay NaN and are not used as references; a trajectory with no finite reference gets 0.5.
    Place it after the callbacks that add turn rewards (e.g. ``OverlongPenalty``): it folds in what
    they added, and turn rewards added after it are not bounded. Stateless.

    Logs ``train/bounded_reward/raw_mean`` (mean reward before) and ``train/bounded_reward/mean``
    (after), over the finite rewards.

    Args:
        k: slope of the sigmoid (> 0).
        reference_rewards: fixed references, or None for the other members of the group.
    """

    def __init__(self, k: float = 1.0, reference_rewards: list[float] | None = None) -> None:
        check_option(_OPTION + "k", k, 0.0, low_open=True)
        if reference_rewards is not None:
            if not reference_rewards:
                raise ConfigError(f"{_OPTION}reference_rewards is empty: give one value or more, or null for the group")
            for i, value in enumerate(reference_rewards):
                check_option(f"{_OPTION}reference_rewards[{i}]", value)
        self.k = k
        self.reference_rewards = None if reference_rewards is None else [float(v) for v in reference_rewards]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse group references with groups of one (a trajectory would have nothing to compare to)."""
        grpo = getattr(pl_module, "grpo", None)
        if self.reference_rewards is None and grpo is not None and grpo.group_size < 2:
            raise ConfigError(
                f"BoundedReward compares each reward with the other members of its group, but "
                f"model.init_args.grpo.group_size is {grpo.group_size}: set group_size >= 2, or give fixed "
                f"references with {_OPTION}reference_rewards (e.g. [0.5])."
            )

    def references(self, rollouts: RolloutBatch, rewards: Tensor) -> Tensor:  # [N, R]
        """The reference rewards of each trajectory."""
        if self.reference_rewards is None:
            return group_references(rewards, rollouts.group_size)
        return torch.tensor(self.reference_rewards, dtype=rewards.dtype).expand(rewards.numel(), -1)

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        raw = rollouts.rewards.float().clone()
        raw.index_add_(0, rollouts.turn_to_trajectory, rollouts.turn_rewards.float())
        raw = torch.where(torch.isinf(raw), torch.full_like(raw, math.nan), raw)
        rollouts.rewards = bounded_rewards(raw, self.references(rollouts, raw), self.k)
        rollouts.turn_rewards = torch.zeros_like(rollouts.turn_rewards)
        finite = torch.isfinite(raw)
        if finite.any():
            module.log("train/bounded_reward/raw_mean", float(raw[finite].mean()))
            module.log("train/bounded_reward/mean", float(rollouts.rewards[finite].mean()))
