"""A reward that reads the trajectory's memories, added to the reward list from YAML.

MemAgent's typical failure is forgetting: a memory turn drops the answer before the answer turn
reads the memory. :class:`MemoryRecall` scores how much of the gold answer survives into the final
memory, so a group member that kept the answer gets a higher advantage than one that lost it.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/memagent/tiny.yaml --config
examples/memory_recall_reward.yaml``.
"""

from __future__ import annotations

from lightning_memrl.rewards import RewardFunction, normalize_answer
from lightning_memrl.types import Trajectory


class MemoryRecall(RewardFunction):
    """Share of the gold answers found in the final memory.

    ``score = |{a in answers : normalize(a) occurs in normalize(memories[-1])}| / |answers|``
    (SQuAD normalisation; an answer that normalises to nothing never counts). A trajectory without
    memory turns or without gold answers is left unscored (None).

    Args:
        weight: weight in the sum of reward functions.
        name: log key (``train/reward/<name>``).
    """

    default_name = "memory_recall"

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__(weight, name)

    def score(self, trajectory: Trajectory) -> float | None:
        answers = trajectory.task.answers
        if not trajectory.memories or not answers:
            return None
        memory = normalize_answer(trajectory.memories[-1])
        kept = [a for a in answers if normalize_answer(a) and normalize_answer(a) in memory]
        return len(kept) / len(answers)
