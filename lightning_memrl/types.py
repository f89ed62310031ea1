"""The data contracts: a task, the turns and trajectories a workflow produces, and the batch the update sees.

Shapes: ``N`` trajectories per step (``num_tasks * group_size``, groups contiguous), ``M`` trainable
turns, ``T`` the longest response of a turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor


@dataclass
class Task:
    """One question over a long context."""

    question: str
    context: list[str] | str  # chunks, or one text to cut into chunks of chunk_tokens
    answers: list[str]
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Generation:
    """What the engine returns for one prompt."""

    token_ids: list[int]  # generated ids up to and including EOS / stop string
    logprobs: Tensor  # [len(token_ids)] float32, under logits / temperature
    truncated: bool  # hit max_new_tokens without EOS or a stop string


MEMORY_TURN = "memory"


ANSWER_TURN = "answer"


@dataclass
class Turn:
    """One conversation of a trajectory: the exact prompt and generated token ids."""

    kind: str  # MEMORY_TURN or ANSWER_TURN (or a workflow's own kind, e.g. "extract")
    prompt_ids: list[int]
    generation: Generation
    text: str = ""  # decoded response (for rewards and logs only; never re-tokenised)
    trainable: bool = True  # False: a frozen agent's turn, left out of the update (no loss)
    reward: float = 0.0  # per-turn reward (e.g. a format penalty), summed into the trajectory's
    info: dict[str, Any] = field(default_factory=dict)  # workflow extras, e.g. wrote_entries {bank entry id: text}


@dataclass
class Trajectory:
    """All turns one group member produced for one task."""

    task: Task
    turns: list[Turn] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)  # memory text after each memory turn
    chunks: list[str] = field(default_factory=list)  # the chunks the agent read, in order
    chunks_dropped: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # workflow extras (retrieved ids, op counts, ...)

    @property
    def final_text(self) -> str:
        """Decoded response of the last turn (the answer)."""
        return self.turns[-1].text if self.turns else ""


@dataclass
class RolloutBatch:
    """Trajectories of one step and their turns flattened for the update.

    Per-trajectory fields have ``N`` rows (``num_tasks * group_size``, groups contiguous); per-turn
    fields have ``M`` rows. Callbacks may change ``rewards`` and ``turn_rewards`` in
    ``on_rewards`` and ``advantages`` in ``on_advantages``.
    """

    trajectories: list[Trajectory]
    group_size: int
    prompt_ids: list[list[int]]  # M prompts
    response_ids: Tensor  # [M, T] right-padded generated ids
    response_mask: Tensor  # [M, T] 1 on generated tokens
    rollout_logprobs: Tensor  # [M, T] sampling log-probs from the engine
    turn_to_trajectory: Tensor  # [M] long
    memory_turns: Tensor  # [M] bool, one flag per turn: True where the turn writes memory (kind MEMORY_TURN)
    truncated: Tensor  # [M] bool
    rewards: Tensor = field(default_factory=lambda: torch.empty(0))  # [N]
    reward_components: dict[str, Tensor] = field(default_factory=dict)  # name -> [N]
    turn_rewards: Tensor = field(default_factory=lambda: torch.empty(0))  # [M], summed into rewards
    trajectory_advantages: Tensor = field(default_factory=lambda: torch.empty(0))  # [N]
    advantages: Tensor = field(default_factory=lambda: torch.empty(0))  # [M, T]

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], group_size: int, pad_id: int) -> RolloutBatch:
        """Flatten the trainable turns of ``trajectories`` into padded tensors."""
        turns = [(i, t) for i, traj in enumerate(trajectories) for t in traj.turns if t.trainable]
        width = max((len(t.generation.token_ids) for _, t in turns), default=1) or 1
        num_turns = len(turns)
        response_ids = torch.full((num_turns, width), pad_id, dtype=torch.long)
        response_mask = torch.zeros((num_turns, width), dtype=torch.long)
        logprobs = torch.zeros((num_turns, width))
        for row, (_, turn) in enumerate(turns):
            n = len(turn.generation.token_ids)
            response_ids[row, :n] = torch.tensor(turn.generation.token_ids, dtype=torch.long)
            response_mask[row, :n] = 1
            logprobs[row, :n] = turn.generation.logprobs
        return cls(
            trajectories=trajectories,
            group_size=group_size,
            prompt_ids=[t.prompt_ids for _, t in turns],
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            turn_to_trajectory=torch.tensor([i for i, _ in turns], dtype=torch.long),
            memory_turns=torch.tensor([t.kind == MEMORY_TURN for _, t in turns], dtype=torch.bool),
            truncated=torch.tensor([t.generation.truncated for _, t in turns], dtype=torch.bool),
            turn_rewards=torch.tensor([float(t.reward) for _, t in turns]),
        )

    def append_turns(self, turns: list[Turn], trajectory_indices: list[int], pad_id: int) -> list[int]:
        """Add ``turns`` as extra trainable rows (e.g. re-rolls of a turn), each tied to a trajectory.

        The rows are not added to any ``Trajectory.turns``: they take part in the update only. Responses
        are right-padded to the wider of the batch's and the new turns' widths; a new row's turn reward
        is the turn's ``reward`` and, when advantages were already assigned, its advantages are 0.

        Args:
            turns: the turns to add, in order.
            trajectory_indices: for each turn, the trajectory (row of ``rewards``) it belongs to.
            pad_id: token id that pads responses.

        Returns:
            The row index of each added turn.

        Raises:
            ValueError: ``turns`` and ``trajectory_indices`` differ in length, an index is out of range, or a
                turn is not trainable.
        """
        if len(turns) != len(trajectory_indices):
            raise ValueError(f"append_turns: {len(turns)} turns but {len(trajectory_indices)} trajectory indices")
        if not all(t.trainable for t in turns):
            raise ValueError("append_turns: every added turn must be trainable (an added row is trained)")
        if any(not 0 <= i < self.num_trajectories for i in trajectory_indices):
            raise ValueError(f"append_turns: indices {trajectory_indices} not in [0, {self.num_trajectories})")
        first = self.response_ids.shape[0]
        if not turns:
            return []
        extra = RolloutBatch.from_trajectories([Trajectory(task=Task("", "", []), turns=list(turns))], 1, pad_id)
        width = max(self.response_ids.shape[1], extra.response_ids.shape[1])

        def stack(old: Tensor, new: Tensor, fill: float) -> Tensor:  # [M, T] and [m, t] -> [M + m, width]
            pad = [torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill) for x in (old, new)]
            return torch.cat(pad)

        if self.advantages.numel():
            self.advantages = stack(self.advantages, torch.zeros_like(extra.rollout_logprobs), 0.0)
        self.response_ids = stack(self.response_ids, extra.response_ids, pad_id)
        self.response_mask = stack(self.response_mask, extra.response_mask, 0)
        self.rollout_logprobs = stack(self.rollout_logprobs, extra.rollout_logprobs, 0.0)
        self.prompt_ids = [*self.prompt_ids, *extra.prompt_ids]
        self.turn_to_trajectory = torch.cat([self.turn_to_trajectory, torch.tensor(trajectory_indices)])
        self.memory_turns = torch.cat([self.memory_turns, extra.memory_turns])
        self.truncated = torch.cat([self.truncated, extra.truncated])
        self.turn_rewards = torch.cat([self.turn_rewards, extra.turn_rewards])
        return list(range(first, first + len(turns)))

    @property
    def num_trajectories(self) -> int:
        return len(self.trajectories)

    def with_placeholder_row(self, pad_id: int) -> RolloutBatch:
        """A copy holding one zero-advantage row (one pad token) instead of its turns.

        Under sharding every rank must run the same forward/backward passes; a rank without a
        trainable turn runs this row, its loss scaled by zero, to join the other ranks' passes.
        """
        return replace(
            self,
            prompt_ids=[[pad_id]],
            response_ids=torch.full((1, 1), pad_id, dtype=torch.long),
            response_mask=torch.ones((1, 1), dtype=torch.long),
            rollout_logprobs=torch.zeros((1, 1)),
            turn_to_trajectory=torch.zeros(1, dtype=torch.long),
            memory_turns=torch.zeros(1, dtype=torch.bool),
            truncated=torch.zeros(1, dtype=torch.bool),
            turn_rewards=torch.zeros(1),
            advantages=torch.zeros((1, 1)),
        )
