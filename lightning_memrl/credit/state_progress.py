"""State-progress advantage: ReMemR1's multi-level rewards (Shi et al., Look Back to Reason Forward: Revisitable
Memory for Long-Context LLM Agents, ICLR 2026, arXiv:2509.23040).

ReMemR1 mixes the outcome advantage of a trajectory with a dense step-level advantage: each memory
update is rewarded for the progress its new memory state makes towards holding the answer, and
that state reward is normalised among the group's trajectories at the same step.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.advantages import GroupRelative
from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import answer_word_recall
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.types import MEMORY_TURN, RolloutBatch, Trajectory

_OPTION = "trainer.callbacks[StateProgressAdvantage].init_args."


def recall_gains(trajectory: Trajectory) -> list[float]:
    """``rec(m_k) − rec(m_{k−1})`` for each memory ``m_k`` of ``trajectory`` (``m_{−1}`` the empty memory).

    ``rec`` is :func:`~lightning_memrl.credit.answer_presence.answer_word_recall`: the largest
    fraction of a gold answer's words present in the memory.
    """
    answers = trajectory.task.answers
    recalls = [0.0] + [answer_word_recall(memory, answers) for memory in trajectory.memories]
    return [after - before for before, after in zip(recalls, recalls[1:])]


def normalise_per_index(values: Tensor, present: Tensor, eps: float) -> Tensor:  # [G, K], [G, K] -> [G, K]
    """Z-score each column (one turn index of one group) over its present entries (unbiased std, as GRPO).

    A column with fewer than two present entries gets 0; absent entries get 0.
    """
    count = present.sum(0, keepdim=True)  # [1, K]
    filled = torch.where(present, values, torch.zeros_like(values))
    mean = filled.sum(0, keepdim=True) / count.clamp(min=1)
    centered = torch.where(present, values - mean, torch.zeros_like(values))
    scale = ((centered**2).sum(0, keepdim=True) / (count - 1).clamp(min=1)).sqrt() + eps
    normalised = centered / torch.where(scale > 0, scale, torch.ones_like(scale))  # equal values: 0, not 0/0
    return torch.where(present & (count > 1), normalised, torch.zeros_like(values))


class StateProgressAdvantage(MemRLCallback):
    """ReMemR1's state-progress advantage (arXiv:2509.23040), written per turn in ``on_advantages``.

    As implemented, for trajectory ``i`` of group ``g`` and its ``k``-th memory turn::

        A_out[i]     = r_i − mean_{j in g} r_j                        (the step's rewards, NaN -> A_out 0)
        r_state[i,k] = r_format[i,k] + rec(m_k) − rec(m_{k−1})        (m_{−1}: the empty memory)
        A_state[i,k] = (r_state[i,k] − mean_g r_state[.,k]) / (std_g r_state[.,k] + eps)
        A[i,k]       = alpha · A_out[i] + (1 − alpha) · A_state[i,k]   on every token of that turn

    ``rec`` is the fraction of a gold answer's words present in the memory
    (:func:`~lightning_memrl.credit.answer_presence.answer_word_recall`), ``r_format`` the memory
    turn's own reward (``rollouts.turn_rewards``: the workflow's per-turn reward, e.g. a format
    penalty, plus what ``on_rewards`` callbacks added to that turn), and the mean and (unbiased)
    std run over the members of group ``g`` that have a ``k``-th memory turn (fewer than two: 0).
    Answer turns (every turn that is not a memory turn) take ``A = A_out``: the outcome reward is
    their own state reward. Turns that are not trained (a frozen agent's) take no row.

    This replaces the configured advantage estimator's per-token advantages (``rollouts.advantages``
    [M, T]); ``rollouts.trajectory_advantages`` (logged as ``train/advantage_abs``) stays the
    estimator's. Put it first among the ``on_advantages`` callbacks. Stateless.

    Works with workflows whose memory turn ``k`` writes ``trajectory.memories[k]``
    (``Workflow.memory_per_chunk``: MemAgent); any other workflow is refused at setup.

    Logs ``train/state_progress/state_reward`` (mean ``r_state`` over memory turns),
    ``train/state_progress/recall_gain`` (mean ``rec(m_k) − rec(m_{k−1})``) and
    ``train/state_progress/final_recall`` (mean ``rec`` of the last memory).

    Args:
        alpha: weight of the outcome advantage (ReMemR1: 0.8).
        eps: added to the std of a turn index, so equal state rewards give 0.
    """

    def __init__(self, alpha: float = 0.8, eps: float = 1e-4) -> None:
        check_option(_OPTION + "alpha", alpha, 0.0, 1.0)
        check_option(_OPTION + "eps", eps, 0.0)
        self.alpha, self.eps = alpha, eps

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow whose memory turns do not each write one memory text."""
        workflow = getattr(pl_module, "workflow", None)
        if workflow is not None and not getattr(workflow, "memory_per_chunk", False):
            raise ConfigError(
                f"StateProgressAdvantage cannot reward the memory states of {type(workflow).__name__}: it scores "
                "memory turn k by how much more of the gold answer trajectory.memories[k] holds than the memory "
                "before it, and this workflow records no memory text per memory turn (memory_per_chunk is False; a "
                "memory-bank workflow's memory turns are operations). Remove the callback for this workflow."
            )

    def state_rewards(self, rollouts: RolloutBatch) -> tuple[list[list[float]], list[list[float]]]:
        """``r_state`` and the recall gains of every memory turn, per trajectory (frozen turns: their ``reward``)."""
        state, gains, row = [], [], 0  # rows are the trainable turns, in trajectory order
        for index, trajectory in enumerate(rollouts.trajectories):
            trajectory_gains = recall_gains(trajectory)
            memory_turns = [t for t in trajectory.turns if t.kind == MEMORY_TURN]
            if len(trajectory_gains) != len(memory_turns):
                raise ValueError(
                    f"StateProgressAdvantage: trajectory {index} (task {trajectory.task.id!r}) has "
                    f"{len(memory_turns)} memory turns but {len(trajectory_gains)} memories; its workflow must record "
                    "the memory written by each memory turn"
                )
            gain_of, rewards = iter(trajectory_gains), []
            for turn in trajectory.turns:
                turn_reward = float(rollouts.turn_rewards[row]) if turn.trainable else turn.reward
                row += turn.trainable
                if turn.kind == MEMORY_TURN:
                    rewards.append(turn_reward + next(gain_of))
            state.append(rewards)
            gains.append(trajectory_gains)
        return state, gains

    def state_advantages(self, state: list[list[float]], group_size: int) -> list[list[float]]:
        """``A_state``: ``state`` normalised within each (group, memory-turn index)."""
        out: list[list[float]] = []
        for start in range(0, len(state), group_size):
            members = state[start : start + group_size]
            width = max((len(s) for s in members), default=0)
            values = torch.zeros(len(members), width, dtype=torch.float64)
            present = torch.zeros(len(members), width, dtype=torch.bool)
            for i, rewards in enumerate(members):
                values[i, : len(rewards)] = torch.tensor(rewards, dtype=torch.float64)
                present[i, : len(rewards)] = True
            normalised = normalise_per_index(values, present, self.eps)
            out.extend(normalised[i, : len(rewards)].tolist() for i, rewards in enumerate(members))
        return out

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        outcome = GroupRelative(scale_rewards="none").from_rewards(rollouts.rewards, rollouts.group_size)  # [N]
        state, gains = self.state_rewards(rollouts)
        state_advantages = self.state_advantages(state, rollouts.group_size)
        per_row = torch.zeros(rollouts.response_ids.shape[0])  # [M]
        row = 0
        for index, trajectory in enumerate(rollouts.trajectories):
            a_out, memory_k = float(outcome[index]), 0
            for turn in trajectory.turns:
                advantage = a_out
                if turn.kind == MEMORY_TURN:
                    advantage = self.alpha * a_out + (1 - self.alpha) * state_advantages[index][memory_k]
                    memory_k += 1
                if turn.trainable:
                    per_row[row] = advantage
                    row += 1
        rollouts.advantages = per_row.unsqueeze(-1) * rollouts.response_mask  # [M, T]
        all_state = [r for rewards in state for r in rewards]
        if all_state:  # a batch without memory turns logs nothing
            all_gains = [g for trajectory_gains in gains for g in trajectory_gains]
            final = [sum(g) for g in gains if g]  # rec(m_last) − rec(m_{−1}) = rec(m_last)
            module.log("train/state_progress/state_reward", sum(all_state) / len(all_state))
            module.log("train/state_progress/recall_gain", sum(all_gains) / len(all_gains))
            module.log("train/state_progress/final_recall", sum(final) / len(final))
