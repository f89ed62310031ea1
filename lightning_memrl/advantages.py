"""Advantage estimators: how a step's rewards become one advantage per trajectory.

:class:`~lightning_memrl.module.MemRLModule` takes one as ``advantage`` (default
:class:`GroupRelative`), chosen in YAML by class path::

    model:
      init_args:
        advantage:
          class_path: lightning_memrl.advantages.GroupRelative
          init_args:
            scale_rewards: none   # Dr. GRPO

A new estimator is one file: subclass :class:`AdvantageEstimator` and implement
:meth:`~AdvantageEstimator.from_rewards` (or ``__call__`` when it needs more than the rewards);
``examples/custom_advantages.py`` is one (RLOO). An estimator that sets ``per_turn = True``
returns one advantage per trainable turn ([M], e.g.
:class:`~lightning_memrl.credit.turn_level.TurnLevelAdvantage`) instead of one per trajectory.
Shapes: ``N`` trajectories (``num_tasks * group_size``, the members of a group contiguous), ``G``
the group size, ``M`` turns, ``T`` the padded response length.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.types import RolloutBatch

ScaleRewards = Literal["group", "batch", "none"]


class AdvantageEstimator:
    """How per-trajectory rewards become per-trajectory advantages: the contract.

    ``MemRLModule`` calls ``estimator(rollouts)`` once per training step, after the reward
    functions and the callbacks' ``on_rewards`` have filled ``rollouts.rewards``. It receives the
    step's :class:`~lightning_memrl.types.RolloutBatch`: ``rewards`` [N] (float; NaN marks a
    trajectory without a usable reward), ``group_size`` G, and the trajectories and turns for an
    estimator that needs them. It returns one advantage per trajectory, [N] float32, which the
    module broadcasts to every generated token of the trajectory's trainable turns ([M, T]) before
    the callbacks' ``on_advantages``.

    Rules: a NaN reward gets advantage 0 and is left out of every other trajectory's baseline;
    the result is finite. The default ``__call__`` hands :meth:`from_rewards` the rewards and the
    group size, which is all a group-baseline method needs.

    Per-turn estimators: a subclass that sets the class attribute ``per_turn = True`` returns one
    advantage per trainable turn instead, [M] float32 in the row order of ``rollouts.response_ids``;
    each turn's tokens get its own advantage, and ``trajectory_advantages`` (for the metrics) is the
    mean over each trajectory's turns. The choice is declared, not guessed from the shape: ``N`` and
    ``M`` are equal whenever every trajectory has one turn. :meth:`metrics` may return what the last
    call measured; the module logs it as ``train/<key>``.
    """

    per_turn: bool = False  # True: __call__ returns one advantage per trainable turn [M]

    def __call__(self, rollouts: RolloutBatch) -> Tensor:  # [N]
        """One advantage per trajectory of ``rollouts``."""
        return self.from_rewards(rollouts.rewards, rollouts.group_size)

    def from_rewards(self, rewards: Tensor, group_size: int) -> Tensor:  # [N] -> [N]
        """Advantages from ``rewards`` [N], whose ``group_size`` members of a group are contiguous."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement from_rewards(rewards, group_size) or __call__(rollouts)"
        )

    def metrics(self) -> dict[str, float]:
        """What the last call measured, logged by the module as ``train/<key>`` (none by default)."""
        return {}


def grouped_rewards(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``rewards`` [N] as groups [N/G, G] in float64 with non-finite entries set to 0, and the finite mask.

    Float64: float32 squares overflow above ~1e19, so rewards as large as 1e30 keep their advantages.
    """
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    r = rewards.double().view(-1, group_size)  # [N/G, G]
    valid = torch.isfinite(r)
    return torch.where(valid, r, torch.zeros_like(r)), valid


def _group_std(centered: Tensor, filled: Tensor, valid: Tensor) -> Tensor:  # [N/G, 1]
    """Unbiased std of each group's valid rewards, as torch.std (TRL)."""
    count = valid.sum(-1, keepdim=True)
    return ((centered**2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()


def _batch_std(centered: Tensor, filled: Tensor, valid: Tensor) -> Tensor:  # []
    """Unbiased std of all valid rewards of the batch (0 with fewer than two)."""
    flat = filled[valid]
    return flat.std() if flat.numel() > 1 else torch.zeros((), dtype=filled.dtype)


_STD = {"group": _group_std, "batch": _batch_std}  # scale_rewards: none divides by nothing


class GroupRelative(AdvantageEstimator):
    """GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    ``A_i = (r_i - mean_g(r)) / (std + eps)`` over the valid rewards ``r`` of trajectory ``i``'s
    group ``g``. ``std`` is chosen by ``scale_rewards`` (as TRL names it): ``group``, the
    unbiased std of the group (GRPO); ``batch``, the unbiased std of every valid reward of the
    batch, the mean staying per group; ``none``, no division at all: ``A_i = r_i - mean_g(r)``
    (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783). A NaN or ±inf reward gets 0 and is left out of
    its group's mean and std; a group with fewer than two valid rewards gets 0 everywhere.

    Args:
        scale_rewards: ``group``, ``batch`` or ``none``.
        eps: added to the std so a zero-variance group gives 0, not NaN.
    """

    def __init__(self, scale_rewards: ScaleRewards = "group", eps: float = 1e-4) -> None:
        p = "model.init_args.advantage.init_args."
        if scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(f"{p}scale_rewards must be 'group', 'batch' or 'none' (got {scale_rewards!r})")
        check_option(p + "eps", eps, 0.0)
        self.scale_rewards, self.eps = scale_rewards, eps

    def from_rewards(self, rewards: Tensor, group_size: int) -> Tensor:  # [N] -> [N] float32
        filled, valid = grouped_rewards(rewards, group_size)  # [N/G, G]
        count = valid.sum(-1, keepdim=True)  # [N/G, 1]
        mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)
        centered = torch.where(valid, filled - mean, torch.zeros_like(filled))
        std = _STD.get(self.scale_rewards)
        if std is not None:
            centered = centered / (std(centered, filled, valid) + self.eps)
        centered = torch.where(count > 1, centered, torch.zeros_like(centered))
        return centered.view(-1).float()


def assign_advantages(rollouts: RolloutBatch, estimator: AdvantageEstimator) -> None:
    """Set ``rollouts.trajectory_advantages`` [N] by ``estimator`` and ``rollouts.advantages`` [M, T].

    Every generated token of a trajectory's trainable turns gets the trajectory's advantage; with a
    ``per_turn`` estimator every token of a turn gets the turn's advantage, and a trajectory's
    advantage is the mean of its turns' (0 without a trainable turn).

    Raises:
        ValueError: the estimator returned something other than one number per trajectory (per turn).
    """
    advantages = estimator(rollouts)
    per_turn = getattr(estimator, "per_turn", False)
    rows, what = (rollouts.response_ids.shape[0], "turn") if per_turn else (rollouts.num_trajectories, "trajectory")
    if not isinstance(advantages, Tensor) or advantages.shape != (rows,):
        shape = tuple(advantages.shape) if isinstance(advantages, Tensor) else type(advantages).__name__
        raise ValueError(
            f"advantage estimator {type(estimator).__name__} returned {shape}; expected one advantage "
            f"per {what}, a tensor of shape ({rows},)"
        )
    if per_turn:
        rollouts.trajectory_advantages = turn_means(advantages, rollouts.turn_to_trajectory, rollouts.num_trajectories)
        per_row = advantages  # [M]
    else:
        rollouts.trajectory_advantages = advantages  # [N]
        per_row = advantages[rollouts.turn_to_trajectory]  # [M]
    rollouts.advantages = per_row.unsqueeze(-1) * rollouts.response_mask  # [M, T]


def turn_means(values: Tensor, turn_to_trajectory: Tensor, num_trajectories: int) -> Tensor:  # [M] -> [N]
    """Mean of each trajectory's per-turn ``values`` (0 for a trajectory without a turn)."""
    sums = torch.zeros(num_trajectories, dtype=values.dtype).index_add_(0, turn_to_trajectory, values)
    ones = torch.ones_like(values)
    counts = torch.zeros(num_trajectories, dtype=values.dtype).index_add_(0, turn_to_trajectory, ones)
    return sums / counts.clamp(min=1)
