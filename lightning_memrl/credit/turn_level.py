"""Turn-level advantage: each turn's reward normalised against the same turn of the other group members.

MemoPilot (Cai et al. 2026, "From Player to Master", arXiv:2606.08656) trains a memory updater with
multi-turn GRPO whose advantage is estimated per turn, across the rollouts of a group, from a
turn-wise reward, instead of one trajectory advantage copied onto every turn; AgeMem (Yu et al.
2026, "Agentic Memory", arXiv:2601.01885) calls its variant step-wise GRPO. Here a turn's reward is
what this library already attaches to turns (``RolloutBatch.turn_rewards``: format penalties,
shaping callbacks) with the trajectory's outcome added on its last turn.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import Tensor

from lightning_memrl.advantages import AdvantageEstimator
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.types import RolloutBatch

log = logging.getLogger(__name__)


def turn_positions(turn_to_trajectory: Tensor) -> Tensor:  # [M] long
    """Index ``k`` of each turn within its trajectory's trainable turns (0 for its first), in row order."""
    seen: dict[int, int] = {}
    positions = []
    for trajectory in turn_to_trajectory.tolist():
        positions.append(seen.get(trajectory, 0))
        seen[trajectory] = positions[-1] + 1
    return torch.tensor(positions, dtype=torch.long)


def turn_level_rewards(rollouts: RolloutBatch) -> Tensor:  # [M] float64
    """``r_{i,k}``: the turn reward, plus on trajectory ``i``'s last trainable turn its outcome.

    The outcome is the trajectory reward without its turn rewards (``rewards`` already holds their
    sum): ``o_i = R_i - sum_k t_{i,k}``, so each turn reward counts once. A NaN ``R_i`` makes every
    turn of ``i`` NaN (no advantage, left out of the others' baselines).
    """
    owner = rollouts.turn_to_trajectory
    turn = rollouts.turn_rewards.double()
    turn_sums = torch.zeros(rollouts.num_trajectories, dtype=torch.float64).index_add_(0, owner, turn)
    outcome = rollouts.rewards.double() - turn_sums  # [N]
    last_row = torch.full((rollouts.num_trajectories,), -1, dtype=torch.long)
    last_row[owner] = torch.arange(owner.numel())  # index_put keeps the last write per trajectory: its last turn
    is_last = torch.zeros(owner.numel(), dtype=torch.bool)
    is_last[last_row[last_row >= 0]] = True
    rewards = turn + torch.where(is_last, outcome[owner], torch.zeros_like(turn))
    return torch.where(torch.isnan(outcome[owner]), torch.full_like(turn, float("nan")), rewards)


class TurnLevelAdvantage(AdvantageEstimator):
    """Per-turn advantages normalised per (group, turn index) (MemoPilot arXiv:2606.08656; AgeMem arXiv:2601.01885).

    As implemented, for turn ``k`` (the k-th trainable turn, from 0) of trajectory ``i`` in group ``g``:

    ``r_{i,k} = t_{i,k} + [k = K_i - 1] * o_i`` (turn reward, plus the outcome on the last turn, see
    :func:`turn_level_rewards`), and ``A_{i,k} = (r_{i,k} - mean_{j in g: K_j > k} r_{j,k}) / (std + eps)``
    over the members of the group that have a valid turn ``k``; ``std`` is their unbiased std
    (``scale_rewards: group``, as GRPO) or 1 (``none``, Dr. GRPO's centring only). A turn whose
    (group, index) cell holds fewer than two valid turns gets 0, as does every turn of a NaN reward.

    Why the outcome on the last turn only: both papers score each turn by its own reward and compare
    it with the same turn of the other rollouts ("context-independent"), so a turn is credited for
    what it did, not for the whole trajectory's result. With ``turn_rewards`` all zero (no turn
    shaping) only the last turns carry a signal: combine it with a turn-reward callback (e.g.
    ``OverlongPenalty`` with ``turns: memory``) or use the trajectory-level ``GroupRelative``.

    Logs ``train/turn_level/turn_indices`` (distinct turn indices of the step),
    ``train/turn_level/frac_unpaired`` (turns alone in their cell: advantage 0),
    ``train/turn_level/turn_reward`` (mean of the valid ``r_{i,k}``) and
    ``train/turn_level/frac_earlier_turns_rewarded`` (turns before a trajectory's last that carry a turn
    reward of their own). When none does, a warning says once that those turns (a MemAgent's memory
    writes) get no advantage: on the multi-chunk ablation this arm then trained only the answer turn.

    Args:
        scale_rewards: ``group`` (divide by the cell's std) or ``none``.
        eps: added to the std so a zero-variance cell gives 0, not NaN.
    """

    per_turn = True

    def __init__(self, scale_rewards: Literal["group", "none"] = "group", eps: float = 1e-4) -> None:
        p = "model.init_args.advantage.init_args."
        if scale_rewards not in ("group", "none"):
            raise ConfigError(f"{p}scale_rewards must be 'group' or 'none' (got {scale_rewards!r})")
        check_option(p + "eps", eps, 0.0)
        self.scale_rewards, self.eps = scale_rewards, eps
        self._metrics: dict[str, float] = {}
        self._warned = False

    def __call__(self, rollouts: RolloutBatch) -> Tensor:  # [M] float32
        rewards = turn_level_rewards(rollouts)  # [M]
        positions = turn_positions(rollouts.turn_to_trajectory)
        width = int(positions.max()) + 1 if positions.numel() else 1
        cell = (rollouts.turn_to_trajectory // rollouts.group_size) * width + positions  # (group, k) -> one id
        cells = int(cell.max()) + 1 if cell.numel() else 0
        valid = ~torch.isnan(rewards)
        filled = torch.where(valid, rewards, torch.zeros_like(rewards))
        count = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell, valid.double())[cell]
        mean = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell, filled)[cell] / count.clamp(min=1)
        centered = torch.where(valid, filled - mean, torch.zeros_like(filled))
        if self.scale_rewards == "group":
            sq = torch.zeros(cells, dtype=torch.float64).index_add_(0, cell, centered**2)[cell]
            centered = centered / ((sq / (count - 1).clamp(min=1)).sqrt() + self.eps)
        paired = valid & (count > 1)
        rewarded = self._earlier_turns_rewarded(rollouts, positions)
        self._metrics = {
            "turn_level/frac_earlier_turns_rewarded": rewarded,
            "turn_level/turn_indices": float(width if positions.numel() else 0),
            "turn_level/frac_unpaired": float((~paired).double().mean()) if paired.numel() else 0.0,
            "turn_level/turn_reward": float(filled[valid].mean()) if valid.any() else 0.0,
        }
        return torch.where(paired, centered, torch.zeros_like(centered)).float()

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _earlier_turns_rewarded(self, rollouts: RolloutBatch, positions: Tensor) -> float:
        """The share of non-last turns with a turn reward; warns once when a batch has such turns and none is."""
        owner = rollouts.turn_to_trajectory
        turns = torch.zeros(rollouts.num_trajectories, dtype=torch.long).index_add_(0, owner, torch.ones_like(owner))
        earlier = positions < turns[owner] - 1  # [M] every turn but its trajectory's last
        rewarded = earlier & (rollouts.turn_rewards != 0)
        if earlier.any() and not rewarded.any() and not self._warned:
            self._warned = True
            log.warning(
                "TurnLevelAdvantage: no turn before a trajectory's last carries a turn reward (%d such turns in "
                "this batch), so they get no advantage and only last turns train. Add a turn-reward callback "
                "(e.g. lightning_memrl.credit.fine_mem.FineMemCredit) or use GroupRelative.",
                int(earlier.sum()),
            )
        return float(rewarded.sum()) / max(1, int(earlier.sum()))
