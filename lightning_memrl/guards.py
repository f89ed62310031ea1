"""Guards that keep a non-finite number from reaching the weights, the optimizer or a checkpoint.

* :func:`reward_value` checks what a reward function returned: a number (or None), never a string
  or a list. A non-finite number is kept so the caller can count it and leave it out (NaN).
* :func:`guard_rewards` turns a step's non-finite rewards into NaN (no advantage), counts them and
  warns when every reward is NaN.
* :class:`SkipCounter` counts optimizer steps skipped for a non-finite loss or gradient norm and
  stops the run after too many in a row.
* :func:`check_finite_checkpoint` refuses to write a checkpoint that holds a NaN or an infinity.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_memrl import distributed
from lightning_memrl.errors import MemRLError
from lightning_memrl.types import RolloutBatch

log = logging.getLogger(__name__)


class RewardValueError(MemRLError, TypeError):
    """A reward function returned something other than one number or None."""


class NonFiniteTrainingError(MemRLError, RuntimeError):
    """Training produced NaN or infinite numbers that the guards could not keep out."""


def reward_value(value: Any, owner: str) -> float | None:
    """``value`` as a float (possibly non-finite), or None; anything else stops the run.

    Args:
        value: what the reward function returned for one completion.
        owner: how to name the function in the error, e.g. ``reward function 'exact_match' (ExactMatch)``.

    Raises:
        RewardValueError: ``value`` is a string, a sequence, a tensor or array of more than one
            element, or anything else that is not a real number.
    """
    if value is None:
        return None
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:  # a 0-d or 1-element array
        value = value.item()
    if isinstance(value, numbers.Real):  # int, float, bool, NumPy scalars
        return float(value)
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    what = f"{len(value)} values" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
    raise RewardValueError(
        f"{owner} returned {what} ({shown}) for one completion; a reward function returns one number "
        "(int or float) per completion, or None when it cannot score it"
    )


def nonfinite_count(values: Tensor, unscored: Tensor | None = None) -> int:
    """Entries of ``values`` that are NaN or ±inf, not counting those already NaN in ``unscored``."""
    bad = ~torch.isfinite(values)
    if unscored is not None:
        bad &= ~torch.isnan(unscored)
    return int(bad.sum())


def finite_or_nan(values: Tensor) -> Tensor:
    """``values`` with every ±inf replaced by NaN (the advantage leaves NaN rewards out)."""
    return torch.where(torch.isfinite(values), values, torch.full_like(values, math.nan))


def guard_rewards(
    rollouts: RolloutBatch, shaped: Tensor, scored: Tensor, nonfinite: int, step: int
) -> dict[str, float]:
    """Set ``rollouts.rewards`` to ``shaped`` with ±inf as NaN; count non-finite and NaN rewards.

    A NaN reward is left out of its group's baseline and gets advantage 0. Warns when every
    reward of the step is NaN: such a step trains nothing but the KL and entropy terms.

    Args:
        rollouts: the step's batch.
        shaped: the rewards [N] after the callbacks' shaping and the turn rewards.
        scored: the reward functions' rewards [N] (NaN: unscored, not counted again).
        nonfinite: non-finite values the reward functions returned.
        step: the global step, for the warning.
    """
    nonfinite += nonfinite_count(shaped, unscored=scored)  # + shaping's
    rollouts.rewards = finite_or_nan(shaped)
    frac_nan = float(torch.isnan(rollouts.rewards).float().mean()) if rollouts.num_trajectories else 0.0
    if frac_nan == 1.0:
        log.warning(
            "step %d: every reward is NaN (%d trajectories, %d of them non-finite values, the rest unscored): "
            "the advantages are all 0 and the policy learns nothing from this step; check the reward functions",
            step,
            rollouts.num_trajectories,
            nonfinite,
        )
    return {"nonfinite_rewards": float(nonfinite), "frac_reward_nan": frac_nan}


def grads_are_finite(parameters: Iterable[Tensor]) -> bool:
    """True when every existing gradient among ``parameters`` is finite."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return all(bool(torch.isfinite(g).all()) for g in grads)


class SkipCounter:
    """Counts optimizer steps skipped because the loss or the gradient norm was not finite.

    Args:
        max_consecutive: skipped steps in a row after which :meth:`record` raises.
    """

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def record(self, skipped: bool, detail: str) -> None:
        """Record one optimizer step; raise after ``max_consecutive`` skipped steps in a row.

        Args:
            skipped: the step was skipped.
            detail: what was not finite, for the error message (e.g. ``loss=nan, grad_norm=nan``).

        Raises:
            NonFiniteTrainingError: the ``max_consecutive``-th skipped step in a row.
        """
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteTrainingError(
                f"training stopped: {self.consecutive} optimizer steps in a row were skipped because the loss "
                f"or the gradient norm was not finite (last: {detail}). Check the reward functions and lower "
                "model.init_args.optimizer.lr, or raise model.init_args.grpo.max_consecutive_skipped_steps "
                f"(now {self.max_consecutive}) to tolerate more"
            )


def _nonfinite_tensors(named: Iterable[tuple[str, Any]]) -> list[tuple[str, int]]:
    """``(name, count)`` of every floating-point tensor in ``named`` with NaN or infinite entries."""
    out = []
    for name, value in named:
        if isinstance(value, Tensor) and value.is_floating_point():
            local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor shard
            bad = int((~torch.isfinite(local)).sum())
            if bad:
                out.append((name, bad))
    return out


def _optimizer_tensors(states: list[dict[str, Any]]) -> Iterable[tuple[str, Any]]:
    for i, state in enumerate(states):
        for key, per_param in state.get("state", {}).items():
            for field, value in per_param.items():
                yield f"optimizer {i} param {key} {field}", value


def check_finite_checkpoint(checkpoint: dict[str, Any]) -> None:
    """Refuse to save ``checkpoint`` when a weight or an optimizer value is NaN or infinite.

    Raises:
        NonFiniteTrainingError: names the first tensors and how many entries are not finite.
    """
    bad = _nonfinite_tensors(checkpoint.get("state_dict", {}).items())
    bad += _nonfinite_tensors(_optimizer_tensors(checkpoint.get("optimizer_states", [])))
    if distributed.max_over_ranks(int(bool(bad))):  # every rank refuses together: no rank waits in a save
        where = ", ".join(f"{name} ({count})" for name, count in bad[:3]) or "on another rank"
        raise NonFiniteTrainingError(
            f"refusing to save a checkpoint at step {checkpoint.get('global_step', '?')}: "
            f"{sum(c for _, c in bad)} weight or optimizer values are NaN or infinite, e.g. {where}. "
            "The last finite checkpoint is still on disk; resume from it with a lower learning rate"
        )
