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
from lightning_memrl.credit.memory_turns import require_memory_per_chunk
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

    As implemented, for trajectory ``i`` of group ``g`` and each of its turns ``t``::

        A_out[i]     = r_i − mean_{j in g} r_j          (the step's rewards; NaN -> A_out 0; scale_rewards: group
                                                         divides by the group's std, as ReMemR1's code does)
        r_state[i,t] = r_format[i,t] + rec(m_k) − rec(m_{k−1})   if t is the k-th memory turn (m_{−1}: empty)
        r_state[i,t] = r_format[i,t]                             for any other turn (the answer)
        A_state[i,t] = (r_state[i,t] − mean_g r_state[.,t]) / (std_g r_state[.,t] + eps)
        A[i,t]       = alpha · A_out[i] + (1 − alpha) · A_state[i,t]   on every token of turn t

    ``rec`` is the fraction of a gold answer's words present in the memory
    (:func:`~lightning_memrl.credit.answer_presence.answer_word_recall`). ``r_format`` is the turn's
    own reward (``rollouts.turn_rewards``: the workflow's per-turn reward, e.g. a format penalty,
    plus what ``on_rewards`` callbacks added to that turn; ``Turn.reward`` for a frozen turn). The
    mean and (unbiased) std of a turn run over the members of group ``g`` that have that turn: the
    k-th memory turn, or the j-th turn of another kind (fewer than two members: 0). As in ReMemR1's
    code, the answer turn is a step whose state reward is its format reward alone, so with no
    answer-turn rewards its ``A_state`` is 0 and it takes ``alpha · A_out``. Turns that are not
    trained (a frozen agent's) take no row. ReMemR1's revisit reward (for recalled memories) has no
    counterpart here: MemAgent does not recall.

    This replaces the configured advantage estimator's per-token advantages (``rollouts.advantages``
    [M, T]); ``rollouts.trajectory_advantages`` (logged as ``train/advantage_abs``) stays the
    estimator's. Put it first among the ``on_advantages`` callbacks. Stateless.

    Works with workflows whose memory turn ``k`` writes ``trajectory.memories[k]``
    (``Workflow.memory_per_chunk``: MemAgent); any other workflow is refused at setup.

    Logs ``train/state_progress/state_reward`` (mean ``r_state`` of the memory turns),
    ``train/state_progress/recall_gain`` (mean ``rec(m_k) − rec(m_{k−1})``) and
    ``train/state_progress/final_recall`` (mean ``rec`` of the last memory).

    Args:
        alpha: weight of the outcome advantage (ReMemR1: 0.8).
        eps: added to the std of a turn, so equal state rewards give 0.
        scale_rewards: ``none`` (``A_out = r − group mean``) or ``group`` (also divided by the
            group's std + eps, as :class:`~lightning_memrl.advantages.GroupRelative`).
    """

    def __init__(self, alpha: float = 0.8, eps: float = 1e-4, scale_rewards: str = "none") -> None:
        check_option(_OPTION + "alpha", alpha, 0.0, 1.0)
        check_option(_OPTION + "eps", eps, 0.0)
        if scale_rewards not in ("none", "group"):
            raise ConfigError(f"{_OPTION}scale_rewards must be 'none' or 'group' (got {scale_rewards!r})")
        self.alpha, self.eps = alpha, eps
        self.outcome = GroupRelative(scale_rewards=scale_rewards, eps=eps)  # type: ignore[arg-type]

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow whose memory turns do not each write one memory text."""
        require_memory_per_chunk(
            "StateProgressAdvantage",
            getattr(pl_module, "workflow", None),
            "it scores memory turn k by how much more of the gold answer trajectory.memories[k] holds than the "
            "memory before it",
        )

    def state_rewards(self, rollouts: RolloutBatch) -> tuple[list[list[tuple[str, float]]], list[list[float]]]:
        """Per trajectory: ``(turn key, r_state)`` of every turn, and the recall gains of its memory turns.

        The key names the turn across the group: ``memory:k`` for the k-th memory turn, ``<kind>:j``
        for the j-th turn of another kind.
        """
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
            seen: dict[str, int] = {}
            keyed = []
            for turn in trajectory.turns:
                reward = float(rollouts.turn_rewards[row]) if turn.trainable else turn.reward
                row += turn.trainable
                k = seen[turn.kind] = seen.get(turn.kind, -1) + 1
                if turn.kind == MEMORY_TURN:
                    reward += trajectory_gains[k]
                keyed.append((f"{turn.kind}:{k}", reward))
            state.append(keyed)
            gains.append(trajectory_gains)
        return state, gains

    def state_advantages(self, state: list[list[tuple[str, float]]], group_size: int) -> list[list[float]]:
        """``A_state`` of every turn: ``r_state`` normalised within each (group, turn key)."""
        out: list[list[float]] = []
        for start in range(0, len(state), group_size):
            members = state[start : start + group_size]
            keys = list(dict.fromkeys(key for keyed in members for key, _ in keyed))
            column = {key: c for c, key in enumerate(keys)}
            values = torch.zeros(len(members), len(keys), dtype=torch.float64)
            present = torch.zeros(len(members), len(keys), dtype=torch.bool)
            for i, keyed in enumerate(members):
                for key, reward in keyed:
                    values[i, column[key]], present[i, column[key]] = reward, True
            normalised = normalise_per_index(values, present, self.eps)
            out.extend([float(normalised[i, column[key]]) for key, _ in keyed] for i, keyed in enumerate(members))
        return out

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        outcome = self.outcome.from_rewards(rollouts.rewards, rollouts.group_size)  # [N]
        state, gains = self.state_rewards(rollouts)
        state_advantages = self.state_advantages(state, rollouts.group_size)
        per_row = []  # [M]: the trainable turns, in trajectory order
        for index, trajectory in enumerate(rollouts.trajectories):
            for turn, a_state in zip(trajectory.turns, state_advantages[index]):
                if turn.trainable:
                    per_row.append(self.alpha * float(outcome[index]) + (1 - self.alpha) * a_state)
        rollouts.advantages = torch.tensor(per_row).reshape(-1, 1) * rollouts.response_mask  # [M, T]
        memory_state = [r for keyed in state for key, r in keyed if key.startswith(MEMORY_TURN + ":")]
        if memory_state:  # a batch without memory turns logs nothing
            all_gains = [g for trajectory_gains in gains for g in trajectory_gains]
            final = [sum(g) for g in gains if g]  # rec(m_last) − rec(m_{−1}) = rec(m_last)
            module.log("train/state_progress/state_reward", sum(memory_state) / len(memory_state))
            module.log("train/state_progress/recall_gain", sum(all_gains) / len(all_gains))
            module.log("train/state_progress/final_recall", sum(final) / len(final))
