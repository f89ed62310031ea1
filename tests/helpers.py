"""Test helpers shared by several test files."""

from __future__ import annotations

from lightning_memrl.rewards import RewardFunction


class AnswerLength(RewardFunction):
    """Varies across group members even for an untrained model, so advantages are not all zero."""

    default_name = "answer_length"

    def score(self, completion: str, answers: list[str]) -> float:
        return len(completion) / 10
