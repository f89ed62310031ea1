"""Dynamic sampling: train only on groups whose rewards differ, refilled with groups of further tasks.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2; verl's ``algorithm.filter_groups``): a group
whose rewards are all equal has advantage 0 everywhere and only dilutes the batch, so it is dropped,
and further tasks are rolled out until the batch again holds as many groups as it was given.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_memrl import distributed
from lightning_memrl.errors import ConfigError, MemRLError, check_option
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import RolloutBatch, Task

log = logging.getLogger(__name__)


class Sampled(Protocol):
    """What dynamic sampling reads from the LightningModule (``MemRLModule`` is one)."""

    generation: GenerationSettings
    engine: Any  # the rollout backend: its pad_id pads merged batches

    def rollout(self, tasks: list[Task], settings: GenerationSettings) -> RolloutBatch: ...
    def _rewards(self, rollouts: RolloutBatch) -> dict[str, float]: ...  # (c) score, (d) shape, guard
    def log_dict(self, metrics: dict[str, float], **kwargs: Any) -> None: ...


class EmptyStepsError(MemRLError, RuntimeError):
    """Too many steps in a row kept no group: every group's rewards were equal."""


def varied_groups(rewards: Tensor, group_size: int) -> list[int]:
    """Indices of the groups whose finite rewards are not all equal (at least two distinct values).

    A group of NaN rewards, or with one finite reward, has no advantage either and is dropped too.
    """
    r = rewards.double().view(-1, group_size)
    valid = torch.isfinite(r)
    high = torch.where(valid, r, torch.full_like(r, -torch.inf)).amax(-1)
    low = torch.where(valid, r, torch.full_like(r, torch.inf)).amin(-1)
    return (high > low).nonzero().flatten().tolist()


def select_groups(rollouts: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The trajectories of ``groups`` (in that order) with their turns, rewards and reward components."""
    g = rollouts.group_size
    members = torch.tensor([group * g + j for group in groups for j in range(g)], dtype=torch.long)
    rows = torch.isin(rollouts.turn_to_trajectory, members).nonzero().flatten()
    new_index = torch.full((rollouts.num_trajectories,), -1, dtype=torch.long)
    new_index[members] = torch.arange(members.numel())
    turns = rollouts.turn_to_trajectory[rows]
    rows = rows[torch.argsort(new_index[turns], stable=True)]  # turns follow their trajectories' new order
    return replace(
        rollouts,
        trajectories=[rollouts.trajectories[i] for i in members.tolist()],
        prompt_ids=[rollouts.prompt_ids[i] for i in rows.tolist()],
        response_ids=rollouts.response_ids[rows],
        response_mask=rollouts.response_mask[rows],
        rollout_logprobs=rollouts.rollout_logprobs[rows],
        turn_to_trajectory=new_index[rollouts.turn_to_trajectory[rows]],
        memory_turns=rollouts.memory_turns[rows],
        truncated=rollouts.truncated[rows],
        rewards=rollouts.rewards[members],
        reward_components={name: value[members] for name, value in rollouts.reward_components.items()},
        turn_rewards=rollouts.turn_rewards[rows],
    )


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of ``batches`` (same group size and reward functions), responses padded to the widest."""
    if len(batches) == 1:
        return batches[0]
    width = max(b.response_ids.shape[1] for b in batches)

    def cat(name: str, value: float = 0) -> Tensor:
        return torch.cat(
            [F.pad(getattr(b, name), (0, width - getattr(b, name).shape[1]), value=value) for b in batches]
        )

    components = batches[0].reward_components
    offsets = torch.tensor([0] + [b.num_trajectories for b in batches[:-1]]).cumsum(0).tolist()
    return replace(
        batches[0],
        trajectories=[t for b in batches for t in b.trajectories],
        prompt_ids=[p for b in batches for p in b.prompt_ids],
        response_ids=cat("response_ids", pad_id),
        response_mask=cat("response_mask"),
        rollout_logprobs=cat("rollout_logprobs"),
        turn_to_trajectory=torch.cat([b.turn_to_trajectory + o for b, o in zip(batches, offsets)]),
        memory_turns=torch.cat([b.memory_turns for b in batches]),
        truncated=torch.cat([b.truncated for b in batches]),
        rewards=torch.cat([b.rewards for b in batches]),
        reward_components={k: torch.cat([b.reward_components[k] for b in batches]) for k in components},
        turn_rewards=torch.cat([b.turn_rewards for b in batches]),
    )


class DynamicSampling:
    """DAPO's dynamic sampling (arXiv:2503.14476; verl's ``filter_groups``): ``model.init_args.dynamic_sampling``.

    After the step's rewards are scored and shaped (the rewards the advantage sees: the callbacks'
    ``on_rewards`` and the turn rewards included), every group whose finite rewards are all equal
    is dropped (:func:`varied_groups`). While fewer groups are kept than the batch had tasks
    (``B``), a refill round draws ``B`` further tasks from the training tasks, rolls them out, scores
    and shapes them the same way and keeps their varied groups, for at most ``max_extra_batches``
    rounds. The first ``B`` kept groups train (as verl, the surplus of the last round is not used);
    fewer when the rounds ran out. A step that keeps no group (on any rank) trains on an empty batch:
    as the update's step without a trainable turn, its optimizer step has no gradient (no weight or
    optimizer moment changes; ``global_step`` and the LR schedule advance, so ``max_steps`` counts
    it), its ``train/reward`` is NaN, and it is counted in ``empty_steps``; after
    ``max_consecutive_empty_steps`` such steps in a row the run stops with an error, as verl's does.

    Refill tasks: ``B`` distinct tasks drawn uniformly from the datamodule's ``train_tasks`` per
    round (``torch.multinomial`` without replacement) by this object's own generator, seeded by
    ``seed``; its state is in the checkpoint, so a resumed run draws what the uninterrupted run
    draws, and the training loader's order and position are left untouched. With several ranks all
    ranks draw the same ``B * world_size`` tasks and each takes its share; they run the same number
    of rounds (the most any rank needs). Callbacks' ``on_rewards`` run once per round.

    Logs per step ``train/dynamic_sampling/kept_groups``, ``dropped_groups`` (all-equal groups over
    every round), ``extra_batches`` (refill rounds), ``extra_rollouts`` (trajectories they rolled
    out), ``refill_s`` (their seconds) and ``empty_steps`` (steps that kept nothing, since the start).

    Args:
        max_extra_batches: refill rounds per step at most; 0 only drops. verl's DAPO recipe allows
            ``max_num_gen_batches: 10`` generation batches, the first included: 9 extra.
        max_consecutive_empty_steps: steps in a row that keep no group before the run stops.
        seed: seed of the refill draws.
    """

    def __init__(self, max_extra_batches: int = 9, max_consecutive_empty_steps: int = 5, seed: int = 0) -> None:
        p = "model.init_args.dynamic_sampling.init_args."
        check_option(p + "max_extra_batches", max_extra_batches, 0, why="0 drops all-equal groups without refilling")
        check_option(p + "max_consecutive_empty_steps", max_consecutive_empty_steps, 1)
        self.max_extra_batches, self.max_consecutive_empty_steps = max_extra_batches, max_consecutive_empty_steps
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.empty_steps, self.consecutive_empty = 0, 0
        self.tasks: list[Task] = []

    def setup(self, datamodule: Any) -> None:
        """Take the training tasks refills are drawn from; refuse a fit without them."""
        tasks = getattr(datamodule, "train_tasks", None)
        what = "no datamodule" if datamodule is None else f"a {type(datamodule).__name__} without them"
        if not tasks:
            raise ConfigError(
                "model.init_args.dynamic_sampling refills a step with tasks drawn from the datamodule's training "
                f"tasks (its train_tasks list), and this fit has {what}: "
                "train with lightning_memrl.MemRLDataModule (the data: section of the config) or remove "
                "dynamic_sampling"
            )
        self.tasks = list(tasks)

    def draw(self, count: int) -> list[Task]:
        """``count`` refill tasks for this rank (all ranks draw the same ``count * world_size`` and split them)."""
        world, rank = distributed.get_world_size(), distributed.get_rank()
        total = count * world
        picks = torch.multinomial(
            torch.ones(len(self.tasks)), total, replacement=total > len(self.tasks), generator=self.generator
        )
        return [self.tasks[i] for i in picks[rank * count : (rank + 1) * count].tolist()]

    def resample(
        self, module: Sampled, rollouts: RolloutBatch, reward_stats: dict[str, float], num_groups: int
    ) -> RolloutBatch:
        """The batch to train on: at most ``num_groups`` varied groups (none: an empty batch).

        ``rollouts`` is the step's scored and shaped batch, returned itself when every group varies.
        ``reward_stats`` (the reward guard's counts) is updated in place to cover every round.
        """
        g = rollouts.group_size
        first = varied_groups(rollouts.rewards, g)
        chosen, kept, varied = [(rollouts, first)], len(first), len(first)
        rolled, nan = rollouts.num_trajectories, reward_stats["frac_reward_nan"] * rollouts.num_trajectories
        rounds, start = 0, time.perf_counter()
        while rounds < self.max_extra_batches and distributed.max_over_ranks(int(kept < num_groups)):
            rounds += 1
            more = module.rollout([task for task in self.draw(num_groups) for _ in range(g)], module.generation)
            stats = module._rewards(more)  # scored and shaped as the first round: the rewards the advantage sees
            reward_stats["nonfinite_rewards"] += stats["nonfinite_rewards"]
            nan += stats["frac_reward_nan"] * more.num_trajectories
            rolled += more.num_trajectories
            groups = varied_groups(more.rewards, g)
            varied += len(groups)
            chosen.append((more, groups[: max(num_groups - kept, 0)]))  # the surplus of a round is not used
            kept += len(chosen[-1][1])
        reward_stats["frac_reward_nan"] = nan / max(rolled, 1)
        empty = not distributed.max_over_ranks(int(kept > 0))
        self.empty_steps += empty
        self.consecutive_empty = self.consecutive_empty + 1 if empty else 0
        metrics = {
            "kept_groups": kept,
            "dropped_groups": rolled // g - varied,
            "extra_batches": rounds,
            "extra_rollouts": rolled - rollouts.num_trajectories,
            "refill_s": time.perf_counter() - start,
            "empty_steps": self.empty_steps,
        }
        module.log_dict({f"train/dynamic_sampling/{k}": float(v) for k, v in metrics.items()}, batch_size=max(kept, 1))
        if empty:
            self._stop_after_too_many_empty_steps(rolled // g, rounds)
        if kept == rollouts.num_trajectories // g and rounds == 0:
            return rollouts
        parts = [select_groups(batch, groups) for batch, groups in chosen if groups]
        return concat_batches(parts or [select_groups(rollouts, [])], module.engine.pad_id)  # no group: empty

    def _stop_after_too_many_empty_steps(self, groups: int, rounds: int) -> None:
        log.warning(
            "dynamic sampling kept none of %d groups (%d refill rounds): every group's rewards were equal; "
            "this step trains nothing (%d in a row)",
            groups,
            rounds,
            self.consecutive_empty,
        )
        if self.consecutive_empty >= self.max_consecutive_empty_steps:
            raise EmptyStepsError(
                f"dynamic sampling: {self.consecutive_empty} steps in a row kept no group (every group's rewards "
                f"were equal after up to {self.max_extra_batches} refill rounds): the tasks are too hard or too easy "
                "for the policy or the reward gives too few distinct values. Raise model.init_args.dynamic_sampling."
                "init_args.max_extra_batches or max_consecutive_empty_steps, add a graded reward, or remove "
                "dynamic_sampling"
            )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the module's hyperparameters in a checkpoint) without the training tasks: setup takes them again."""
        return {**self.__dict__, "tasks": []}

    def state_dict(self) -> dict[str, Any]:
        """The refill generator's state and the empty-step counts (saved in the checkpoint)."""
        return {
            "generator": self.generator.get_state(),
            "empty_steps": self.empty_steps,
            "consecutive_empty": self.consecutive_empty,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self.empty_steps = int(state.get("empty_steps", 0))
        self.consecutive_empty = int(state.get("consecutive_empty", 0))
