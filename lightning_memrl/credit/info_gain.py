"""Information-gain reward: how much the final memory raises the teacher's per-token likelihood of the gold answer.

InfoMem, "Training Long-Context Memory Agents with Answer-Conditioned Information Gain"
(arXiv:2606.03329, code: github.com/GenSouKa1/InfoMem): the gain is applied to successful
trajectories only and normalised before it joins the other rewards.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.credit.memory_turns import grouped_zscore
from lightning_memrl.credit.teacher import DEFAULT_ANSWER_FORMAT, TeacherScoredCallback
from lightning_memrl.errors import ConfigError
from lightning_memrl.rewards import ExactMatch, check_answer_pattern
from lightning_memrl.types import RolloutBatch


def information_gain_bonus(gains: Tensor, success: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """Gains z-scored among each group's successful members; 0 for failures and for a lone success.

    Args:
        gains: information gain of each trajectory (ignored where ``success`` is False).  # [N]
        success: which trajectories succeeded.  # [N] bool

    Returns:
        The normalised bonus.  # [N]
    """
    bonus = torch.zeros(gains.shape[0])
    idx = success.nonzero().flatten().tolist()
    if idx:
        bonus[idx] = grouped_zscore(gains[idx].float(), [i // group_size for i in idx], eps)
    return bonus


class InformationGainReward(TeacherScoredCallback):
    """InfoMem's information-gain reward for MemAgent (a ``MemRLCallback``, ``on_rewards``).

    As implemented, for trajectory ``i`` with final memory ``m_K`` and gold answer ``y`` (``|y|`` tokens):

    - success: the final answer's exact match with a gold answer (:class:`~lightning_memrl.rewards.ExactMatch`
      with ``answer_pattern``), not the reward sum (which may hold format bonuses);
    - ``g_i = (1/|y|)·log p_teacher(y | answer_prompt(q, m_K)) − (1/|y|)·log p_teacher(y | answer_prompt(q, ∅))``
      for successful trajectories only (the others are not scored by the teacher), ``∅`` the
      workflow's empty memory;
    - ``ĝ_i`` = ``g_i`` z-scored among the successful members of its group (unbiased std; 0 for
      failures and for a group's only success);
    - ``rewards[i] += weight · ĝ_i``, before the advantage estimator.

    Args:
        weight: scale of the normalised gain added to the reward.
        answer_pattern: regular expression that picks the answer out for the success check.
        answer_format: the gold answer as the answer turn writes it.
        eps: added to the std of the normalisation.

    Keeps no state between steps (nothing to checkpoint). Refused at setup for a workflow without
    one memory text per chunk (a memory-bank workflow).

    Logs ``train/info_gain/success_rate``, ``train/info_gain/gain`` (mean ``g`` of the successes, when
    any), ``train/info_gain/teacher_seconds`` and ``train/info_gain/teacher_rows``.
    """

    method = "info_gain"

    def __init__(
        self,
        weight: float = 0.1,
        answer_pattern: str | None = None,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(answer_format)
        if weight < 0:
            raise ConfigError(f"InformationGainReward: weight must be >= 0, got {weight}")
        check_answer_pattern(answer_pattern, "InformationGainReward.answer_pattern")
        self.weight, self.eps = weight, eps
        self.exact_match = ExactMatch(answer_pattern=answer_pattern)

    def gains(self, module: L.LightningModule, rollouts: RolloutBatch, success: Tensor) -> Tensor:
        """Per-token log-likelihood gain of the final memory over the empty one, for successful trajectories."""
        gains = torch.zeros(rollouts.num_trajectories)
        idx = success.nonzero().flatten().tolist()
        self.teacher_seconds, self.teacher_rows = 0.0, 0
        if not idx:
            return gains
        chosen = [rollouts.trajectories[i] for i in idx]
        pairs = [(t.task, m) for t in chosen for m in ("", t.memories[-1] if t.memories else "")]
        per_token = self.score_memories(module, pairs).mean.view(-1, 2)  # [S, (empty, final)]
        gains[idx] = per_token[:, 1] - per_token[:, 0]
        return gains

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        success = torch.tensor([(self.exact_match(t) or 0.0) > 0 for t in rollouts.trajectories], dtype=torch.bool)
        gains = self.gains(module, rollouts, success)
        bonus = information_gain_bonus(gains, success, rollouts.group_size, self.eps)
        rollouts.rewards = rollouts.rewards + self.weight * bonus.to(rollouts.rewards)
        n = rollouts.num_trajectories
        module.log("train/info_gain/success_rate", float(success.float().mean()), batch_size=n)
        if success.any():
            module.log("train/info_gain/gain", float(gains[success].mean()), batch_size=n)
        self.log_cost(module, n)
