"""Potential-based turn shaping: each memory write is credited with how much it raised the teacher's
likelihood of the gold answer.

TIPS, "Turn-level Information-Potential reward Shaping" (arXiv:2603.22293, code:
github.com/ucsd-wang-lab-lm/tips) rewards each turn by the change of a teacher's log-likelihood of
the correct answer, a potential-based shaping (Ng et al. 1999) that keeps the task's optimal
policy. PiCA, "Pivot-Based Credit Assignment" (arXiv:2605.09287) builds its step rewards on the
same potential-based form.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.credit.memory_turns import check_one_memory_per_turn, grouped_zscore, memory_turn_rows
from lightning_memrl.credit.teacher import (
    DEFAULT_ANSWER_FORMAT,
    TeacherScoredCallback,
)
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import RolloutBatch


def shaped_returns(potentials: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """Turn rewards ``r_k = γ·Φ_k − Φ_{k−1}`` (k = 1..K) and their returns-to-go ``G_k = Σ_{j≥k} γ^{j−k}·r_j``.

    Args:
        potentials: ``Φ_0..Φ_K`` of one trajectory.  # [K+1]

    Returns:
        ``(r, G)``, each [K].
    """
    rewards = gamma * potentials[1:] - potentials[:-1]
    returns = torch.zeros_like(rewards)
    running = 0.0
    for k in range(rewards.numel() - 1, -1, -1):
        running = float(rewards[k]) + gamma * running
        returns[k] = running
    return rewards, returns


def per_turn_index_advantages(returns: list[Tensor], group_size: int, eps: float = 1e-6) -> list[Tensor]:
    """Returns-to-go normalised per (group, turn index): ``Â_{i,k} = (G_{i,k} − mean_k) / (std_k + eps)``.

    Mean and unbiased std are over the group members that have a turn ``k``; a turn index only one
    member reached gets 0.
    """
    flat = torch.cat([r.float() for r in returns]) if returns else torch.zeros(0)
    keys = [(i // group_size, k) for i, r in enumerate(returns) for k in range(r.numel())]
    normalised = grouped_zscore(flat, keys, eps)
    return list(normalised.split([r.numel() for r in returns]))


class PotentialTurnShaping(TeacherScoredCallback):
    """TIPS / PiCA turn shaping of MemAgent's memory writes (a ``MemRLCallback``, ``on_advantages``).

    As implemented, for trajectory ``i`` with memories ``m_1..m_K`` (``m_0`` the empty memory):

    - ``Φ_k = log p_teacher(y | answer_prompt(q, m_k))``, summed over the gold answer's tokens ``y``
      (``potential: mean``: per token); the teacher is the frozen reference (the LoRA base with the
      adapters disabled, else the frozen copy of the initial weights), scored in one batched
      teacher-forced pass (:func:`~lightning_memrl.credit.teacher.score_answers`).
    - ``r_k = γ·Φ_k − Φ_{k−1}``; ``G_k = Σ_{j≥k} γ^{j−k} r_j`` (with γ = 1: ``Φ_K − Φ_{k−1}``).
    - ``Â_k`` = ``G_k`` normalised across the group per turn index (:func:`per_turn_index_advantages`).
    - Tokens of memory turn ``k``: ``A = A_out + weight · Â_k``; answer turns keep ``A_out`` (the
      outcome advantage of the estimator).

    Args:
        gamma: the shaping discount γ (1: undiscounted, as GRPO's outcome reward).
        weight: scale of the turn advantage added to the outcome advantage.
        potential: ``sum`` (the answer's log-likelihood, TIPS) or ``mean`` (per token).
        answer_format: the gold answer as the answer turn writes it.
        eps: added to the std of the normalisation.

    Keeps no state between steps (nothing to checkpoint). Refused at setup for a workflow without
    one memory text per chunk (a memory-bank workflow).

    Logs ``train/tips/potential_gain`` (mean ``Φ_K − Φ_0``), ``train/tips/turn_reward`` (mean ``r_k``),
    ``train/tips/teacher_seconds`` and ``train/tips/teacher_rows`` (the teacher's cost this step).
    """

    method = "tips"

    def __init__(
        self,
        gamma: float = 1.0,
        weight: float = 0.5,
        potential: str = "sum",
        answer_format: str = DEFAULT_ANSWER_FORMAT,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(answer_format)
        if not 0.0 < gamma <= 1.0:
            raise ConfigError(f"PotentialTurnShaping: gamma must be in (0, 1], got {gamma}")
        if weight < 0:
            raise ConfigError(f"PotentialTurnShaping: weight must be >= 0, got {weight}")
        if potential not in ("sum", "mean"):
            raise ConfigError(f"PotentialTurnShaping: potential must be 'sum' or 'mean', got {potential!r}")
        self.gamma, self.weight, self.potential, self.eps = gamma, weight, potential, eps

    def potentials(self, module: Any, rollouts: RolloutBatch) -> list[Tensor]:
        """``Φ_0..Φ_K`` of every trajectory, from one batched teacher pass."""
        pairs = [(t.task, m) for t in rollouts.trajectories for m in ["", *t.memories]]
        scores = self.score_memories(module, pairs)
        values = scores.total if self.potential == "sum" else scores.mean
        return list(values.split([len(t.memories) + 1 for t in rollouts.trajectories]))

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        check_one_memory_per_turn(rollouts, "PotentialTurnShaping")
        rows = memory_turn_rows(rollouts)
        potentials = self.potentials(module, rollouts)
        shaped = [shaped_returns(phi, self.gamma) for phi in potentials]
        turn_advantages = per_turn_index_advantages([g for _, g in shaped], rollouts.group_size, self.eps)
        bonus = torch.zeros(rollouts.advantages.shape[0])
        for trajectory_rows, advantages in zip(rows, turn_advantages):
            for row, value in zip(trajectory_rows, advantages.tolist()):
                if row is not None:
                    bonus[row] = self.weight * value
        mask = rollouts.response_mask.to(rollouts.advantages.dtype)
        rollouts.advantages = rollouts.advantages + bonus.unsqueeze(-1).to(rollouts.advantages) * mask
        n = rollouts.num_trajectories
        module.log(
            "train/tips/potential_gain", float(torch.stack([p[-1] - p[0] for p in potentials]).mean()), batch_size=n
        )
        turn_rewards = torch.cat([r for r, _ in shaped])
        if turn_rewards.numel():
            module.log("train/tips/turn_reward", float(turn_rewards.mean()), batch_size=n)
        self.log_cost(module, n)
