"""Adaptive length penalty: a per-token penalty whose weight follows the batch's accuracy (A-DLP)."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from lightning_memrl import distributed
from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.types import RolloutBatch

TURN_CHOICES = ("all", "answer", "memory")


class AdaptiveLengthPenalty(MemRLCallback):
    """Adaptive Direct Length Penalty (A-DLP) of "Thinking Fast and Right: Balancing Accuracy and Reasoning
    Length with Adaptive Rewards" (Su & Cardie, arXiv:2505.18298).

    As implemented, at training step ``t`` (in ``on_rewards``):

    * every trainable turn of the chosen kind gets ``-λ_t · len(turn)`` added to its turn reward, so a
      trajectory's reward becomes ``r_i - λ_t · L_i`` with ``L_i`` its generated tokens (the paper's
      ``R = 1{correct} - λ_t · len(y)``);
    * ``acc_t`` = the fraction of the step's scored trajectories (all ranks) whose ``accuracy_reward``
      component is at least ``correct_threshold`` (trajectories that reward left unscored are not counted);
    * ``λ_{t+1} = max(0, λ_t + learning_rate · (acc_t - acc_ref))``: the weight rises while the accuracy is
      above the reference and relaxes when it falls below. ``acc_ref`` is ``reference_accuracy``, or, when
      that is None, the first step's ``acc_t`` (the paper's reference is the starting model's accuracy).

    ``λ``, the measured reference and the step count are checkpointed. Logs ``train/adaptive_length/weight``
    (the ``λ_t`` applied), ``.../accuracy`` (``acc_t``), ``.../reference_accuracy`` and ``.../penalty``
    (the mean ``λ_t · L_i`` over trajectories).

    Args:
        initial_weight: ``λ_0``, the penalty per generated token at the first step (the paper's code:
            ``length_ctrl.lambda_init``; 1e-3).
        learning_rate: ``η``, how fast ``λ`` follows the accuracy gap (1e-3).
        reference_accuracy: ``acc_ref`` in [0, 1]; None measures it on the first step.
        accuracy_reward: name of the reward function whose score says whether a trajectory is correct
            (``exact_match``: :class:`~lightning_memrl.rewards.ExactMatch`).
        correct_threshold: a trajectory is correct when that score is at least this.
        turns: the turns whose tokens are penalised: ``all``, ``answer`` or ``memory``.
    """

    def __init__(
        self,
        initial_weight: float = 1e-3,
        learning_rate: float = 1e-3,
        reference_accuracy: float | None = None,
        accuracy_reward: str = "exact_match",
        correct_threshold: float = 1.0,
        turns: str = "all",
    ) -> None:
        p = "AdaptiveLengthPenalty."
        check_option(p + "initial_weight", initial_weight, 0.0)
        check_option(p + "learning_rate", learning_rate, 0.0)
        if reference_accuracy is not None:
            check_option(p + "reference_accuracy", reference_accuracy, 0.0, 1.0, why="None measures it on step 1")
        check_option(p + "correct_threshold", correct_threshold)
        if turns not in TURN_CHOICES:
            raise ConfigError(f"{p}turns must be one of {', '.join(TURN_CHOICES)} (got {turns!r})")
        self.learning_rate, self.accuracy_reward = learning_rate, accuracy_reward
        self.correct_threshold, self.turns = correct_threshold, turns
        self.weight = float(initial_weight)  # λ_t, saved in checkpoints
        self.reference_accuracy = reference_accuracy  # acc_ref (measured on step 1 when None)
        self.steps = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a run without the reward function that says whether a trajectory is correct."""
        names = [r.name for r in getattr(pl_module, "reward_functions", [])]
        if names and self.accuracy_reward not in names:
            raise ConfigError(
                f"AdaptiveLengthPenalty: accuracy_reward {self.accuracy_reward!r} is not one of this run's reward "
                f"functions {names}; its weight follows the accuracy that reward measures. Set accuracy_reward "
                "to the name of the reward that scores correctness (e.g. exact_match) or add that reward."
            )

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        lengths = rollouts.response_mask.sum(-1).float()  # [M]
        if self.turns == "answer":
            lengths = lengths * (~rollouts.memory_turns)
        elif self.turns == "memory":
            lengths = lengths * rollouts.memory_turns
        applied = self.weight
        rollouts.turn_rewards = rollouts.turn_rewards - applied * lengths
        per_trajectory = torch.zeros(rollouts.num_trajectories).index_add_(0, rollouts.turn_to_trajectory, lengths)
        accuracy = self._accuracy(rollouts)
        if not math.isnan(accuracy):  # a step without a scored trajectory leaves λ as it is
            if self.reference_accuracy is None:
                self.reference_accuracy = accuracy
            self.weight = max(0.0, self.weight + self.learning_rate * (accuracy - self.reference_accuracy))
        self.steps += 1
        if module is not None:
            module.log("train/adaptive_length/weight", applied)
            module.log("train/adaptive_length/accuracy", accuracy)
            module.log("train/adaptive_length/penalty", applied * float(per_trajectory.mean()))
            reference = math.nan if self.reference_accuracy is None else self.reference_accuracy
            module.log("train/adaptive_length/reference_accuracy", reference)

    def _accuracy(self, rollouts: RolloutBatch) -> float:
        """The share of scored trajectories (over all ranks) whose ``accuracy_reward`` reaches the threshold."""
        scores = rollouts.reward_components.get(self.accuracy_reward)
        if scores is None:
            raise ValueError(
                f"AdaptiveLengthPenalty: the step has no reward component {self.accuracy_reward!r} "
                f"(it has {sorted(rollouts.reward_components)}); set accuracy_reward to one of them"
            )
        scored = scores[~torch.isnan(scores)]
        counts = [(int((scored >= self.correct_threshold).sum()), scored.numel())]
        counts = distributed.gather_objects(counts)
        total = sum(n for _, n in counts)
        return sum(c for c, _ in counts) / total if total else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "reference_accuracy": self.reference_accuracy, "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.weight = float(state_dict.get("weight", self.weight))
        self.reference_accuracy = state_dict.get("reference_accuracy", self.reference_accuracy)
        self.steps = int(state_dict.get("steps", 0))
