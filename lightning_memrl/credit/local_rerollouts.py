"""Local re-rollouts (Memory-R2's LoGo-GRPO): re-roll a memory turn from the same pre-write state.

Memory-R2 (arXiv:2605.21768) observes that once group members write different memories they no
longer share an environment, so comparing their trajectory rewards credits memory writes unfairly.
LoGo-GRPO keeps the global (trajectory-level) group and adds *local* groups: a memory operation
re-rolled several times from the same intermediate memory state, whose outcomes are compared with
each other only.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import answer_word_recall
from lightning_memrl.credit.memory_turns import check_one_memory_per_turn, memory_turn_rows, require_memory_per_chunk
from lightning_memrl.errors import ConfigError
from lightning_memrl.learner import score_trajectories
from lightning_memrl.rollout.mode import generation_mode
from lightning_memrl.types import RolloutBatch, Trajectory, Turn

LOCAL_REWARDS = ("outcome", "memory_recall")


class LocalRerollouts(MemRLCallback):
    """LoGo-GRPO (Memory-R2, arXiv:2605.21768): local groups of re-rolled memory turns next to the global group.

    Each step, in ``on_rewards``:

    1. every trajectory is picked with probability ``probability`` (a seeded generator whose state
       is checkpointed); a picked one gets one trainable memory turn ``k``, drawn uniformly;
    2. turn ``k`` is re-rolled ``num_rerollouts`` times from its pre-write state (memory ``m_{k-1}``,
       chunk ``k``) by the workflow's ``reroll_memory_turn``, with the training generation settings,
       the policy in generation mode;
    3. each member ``j`` of the local group ``G`` (the original turn and its re-rolls) is scored:
       ``local_reward: outcome`` (default; Memory-R2 compares the outcomes of memory operations made
       from one state): the workflow's ``continue_rerolls`` reads the remaining chunks from the
       re-rolled memory and answers, and ``r_j`` is the module's weighted reward sum of that
       trajectory (the original's ``r_0`` is the same sum of the original, re-scored); ``memory_recall``
       (no further generation): ``r_j = rec(m_k^j)``, the fraction of gold-answer words in the memory
       the turn wrote (:func:`~lightning_memrl.credit.answer_presence.answer_word_recall`);
    4. the re-rolls are appended to the batch as extra trainable memory-turn rows tied to their
       trajectory (``RolloutBatch.append_turns``; no turn reward, so trajectory rewards are unchanged).

    In ``on_advantages``, on the generated tokens of each local group's rows:

    ``A_j = A_global_j + local_coef * (r_j - mean_{i in G} r_i)``

    with ``A_global`` the trajectory's advantage (whatever earlier callbacks left) on the original
    turn and 0 on a re-roll (a re-roll has no trajectory outcome of its own): the global objective
    trains every turn as before, the local one adds a comparison of writes made from one state. A
    member whose reward is NaN (e.g. unscored) gets no local term and is left out of the mean (counted).
    List this callback after other memory-credit callbacks, so they do not rescale the re-roll rows.
    Re-roll rows count toward their trajectory's tokens under ``loss_aggregation`` and in
    ``train/turns_per_trajectory``.

    Needs a workflow with ``reroll_memory_turn(engine, trajectory, k, n, settings)`` (and, for
    ``outcome``, ``continue_rerolls(engine, trajectory, k, turns, settings)``) whose memory turn ``k``
    writes ``trajectory.memories[k]`` after chunk ``k`` (MemAgent); others are refused at setup.
    Logs ``train/local_rerollouts/rerolled_turns`` (re-roll rows added this step),
    ``train/local_rerollouts/nonfinite_rewards`` (local rewards left out as NaN) and
    ``train/local_rerollouts/local_reward_mean`` (mean finite ``r`` over the step's re-rolls, when any).

    Args:
        probability: chance that a trajectory is re-rolled, in [0, 1].
        num_rerollouts: re-rolls per picked turn (the local group holds this many plus the original).
        local_coef: weight of the local advantage, >= 0.
        local_reward: ``outcome`` or ``memory_recall`` (see 3.).
        seed: seed of the generator that picks trajectories and turns.

    The defaults (``probability`` 0.25, ``num_rerollouts`` 4, ``local_coef`` 1) are this library's
    starting point, not tuned values.
    """

    def __init__(
        self,
        probability: float = 0.25,
        num_rerollouts: int = 4,
        local_coef: float = 1.0,
        local_reward: str = "outcome",
        seed: int = 0,
    ) -> None:
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"LocalRerollouts: probability must be in [0, 1], got {probability}")
        if num_rerollouts < 1:
            raise ValueError(f"LocalRerollouts: num_rerollouts must be >= 1, got {num_rerollouts}")
        if local_coef < 0:
            raise ValueError(f"LocalRerollouts: local_coef must be >= 0, got {local_coef}")
        if local_reward not in LOCAL_REWARDS:
            raise ValueError(f"LocalRerollouts: local_reward must be in {list(LOCAL_REWARDS)}, got {local_reward!r}")
        self.probability, self.num_rerollouts, self.local_coef = probability, num_rerollouts, local_coef
        self.local_reward = local_reward
        self.nonfinite_rewards = 0  # lifetime count, saved in checkpoints
        self.generator = torch.Generator().manual_seed(seed)
        self.rerolled_turns = 0  # lifetime count, saved in checkpoints
        self._local: list[tuple[list[int], list[float]]] = []  # this step's groups: (rows, local advantages)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow that cannot re-roll a memory turn from its pre-write state, and dynamic sampling."""
        if getattr(pl_module, "dynamic_sampling", None) is not None:
            raise ConfigError(
                "LocalRerollouts cannot run with model.init_args.dynamic_sampling: dynamic sampling drops and refills "
                "groups after on_rewards, where this callback has already added its re-rolled rows and noted their "
                "positions. Use one of the two."
            )
        workflow = getattr(pl_module, "workflow", None)
        if workflow is None:
            return
        needs = ["reroll_memory_turn(engine, trajectory, k, n, settings)"]
        if self.local_reward == "outcome":
            needs.append("continue_rerolls(engine, trajectory, k, turns, settings)")
        missing = [m for m in needs if not callable(getattr(workflow, m.split("(")[0], None))]
        if missing:
            raise ConfigError(
                f"LocalRerollouts cannot serve {type(workflow).__name__}: it re-rolls a memory turn from the memory "
                f"state before it (local_reward: {self.local_reward}), and this workflow has no "
                f"{' nor '.join(missing)}. "
                "Use it with MemAgentWorkflow or remove the callback."
            )
        require_memory_per_chunk(
            "LocalRerollouts", workflow, "it scores each re-rolled memory turn by the memory it writes"
        )

    def pick(self, rollouts: RolloutBatch) -> list[tuple[int, int, int]]:
        """``(trajectory, memory turn k, row)`` of each trajectory picked for re-rolls (one draw each)."""
        picks = []
        for index, rows in enumerate(memory_turn_rows(rollouts)):
            draw = float(torch.rand((), generator=self.generator))
            trainable = [(k, row) for k, row in enumerate(rows) if row is not None]
            if draw < self.probability and trainable:
                k, row = trainable[int(torch.randint(len(trainable), (), generator=self.generator))]
                picks.append((index, k, row))
        return picks

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        self._local = []
        check_one_memory_per_turn(rollouts, "LocalRerollouts")
        rerolled: list[Tensor] = []  # local rewards of the re-rolls
        nonfinite = 0
        for index, k, row in self.pick(rollouts):
            trajectory = rollouts.trajectories[index]
            with torch.no_grad(), generation_mode(module.policy):
                turns = module.workflow.reroll_memory_turn(
                    module.engine, trajectory, k, self.num_rerollouts, module.generation
                )
                rewards = self.local_rewards(module, trajectory, k, turns)  # [n + 1], the original first
            rows = [row, *rollouts.append_turns(turns, [index] * len(turns), module.engine.pad_id)]
            finite = torch.isfinite(rewards)
            nonfinite += int((~finite).sum())
            centered = rewards - rewards[finite].mean() if finite.any() else rewards
            self._local.append((rows, torch.where(finite, centered, 0.0).tolist()))
            rerolled.append(rewards[1:][finite[1:]])
        count = sum(len(rows) - 1 for rows, _ in self._local)  # re-roll rows added
        self.rerolled_turns += count
        self.nonfinite_rewards += nonfinite
        module.log("train/local_rerollouts/rerolled_turns", float(count))
        module.log("train/local_rerollouts/nonfinite_rewards", float(nonfinite))
        finite_rerolled = torch.cat(rerolled) if rerolled else torch.empty(0)
        if finite_rerolled.numel():
            module.log("train/local_rerollouts/local_reward_mean", float(finite_rerolled.mean()))

    def local_rewards(self, module: L.LightningModule, trajectory: Trajectory, k: int, turns: list[Turn]) -> Tensor:
        """``[1 + len(turns)]`` local rewards: the original memory turn ``k`` first, then each re-roll."""
        if self.local_reward == "memory_recall":
            memories = [trajectory.memories[k], *(t.text for t in turns)]
            return torch.tensor([answer_word_recall(m, trajectory.task.answers) for m in memories])
        continued = module.workflow.continue_rerolls(module.engine, trajectory, k, turns, module.generation)
        group = RolloutBatch.from_trajectories([trajectory, *continued], 1 + len(turns), module.engine.pad_id)
        return score_trajectories(module.reward_functions, group)[0]

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        for rows, local in self._local:
            rollouts.advantages[rows[1:]] = 0.0  # a re-roll has no global advantage
            mask = rollouts.response_mask[rows].to(rollouts.advantages.dtype)  # [G, T]
            rollouts.advantages[rows] += self.local_coef * torch.tensor(local).unsqueeze(-1) * mask
        self._local = []

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "rerolled_turns": self.rerolled_turns,
            "nonfinite_rewards": self.nonfinite_rewards,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "generator" in state_dict:
            self.generator.set_state(state_dict["generator"])
        self.rerolled_turns = int(state_dict.get("rerolled_turns", 0))
        self.nonfinite_rewards = int(state_dict.get("nonfinite_rewards", 0))
