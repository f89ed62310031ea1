"""Hand-built MemAgent batches and a fake teacher for the teacher-scored credit methods' tests."""

from __future__ import annotations

import torch

from lightning_memrl.credit.teacher import AnswerScores
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.memagent import MemAgentWorkflow

TASK = Task("Where does Alice live?", ["c1", "c2"], ["Paris"], id="t0")


def _turn(kind: str, tokens: int, text: str = "", trainable: bool = True) -> Turn:
    gen = Generation(token_ids=list(range(3, 3 + tokens)), logprobs=torch.zeros(tokens), truncated=False)
    return Turn(kind, [1, 2], gen, text, trainable=trainable)


def memagent_trajectory(memories: list[str], answer: str = "\\boxed{Rome}", frozen: tuple[int, ...] = ()) -> Trajectory:
    """Memory turns of 2 tokens writing ``memories`` (turn k frozen when k in ``frozen``), then a 1-token answer."""
    turns = [_turn(MEMORY_TURN, 2, m, trainable=k not in frozen) for k, m in enumerate(memories)]
    turns.append(_turn(ANSWER_TURN, 1, answer))
    return Trajectory(task=TASK, turns=turns, memories=list(memories), chunks=["c"] * len(memories))


def batch(trajectories: list[Trajectory], group_size: int, advantages: list[float]) -> RolloutBatch:
    """The flattened batch, every token of trajectory i carrying advantage ``advantages[i]`` (pads 0)."""
    rollouts = RolloutBatch.from_trajectories(trajectories, group_size, pad_id=0)
    per_row = torch.tensor(advantages)[rollouts.turn_to_trajectory]
    rollouts.advantages = per_row.unsqueeze(-1) * rollouts.response_mask.float()
    return rollouts


def fake_scores(values: list[float], length: int = 2) -> AnswerScores:
    """Scores whose per-token mean is ``values[i]`` over ``length`` answer tokens (total ``length·v``)."""
    v = torch.tensor(values)
    return AnswerScores(v * length, v.unsqueeze(-1).expand(-1, length).clone(), torch.ones(len(values), length))


class FakeModule:
    """What the callbacks read of the module when the teacher is faked: the workflow and ``log``."""

    def __init__(self, tokenizer=None) -> None:
        self.workflow = MemAgentWorkflow()
        self.tokenizer = tokenizer
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = float(value)
