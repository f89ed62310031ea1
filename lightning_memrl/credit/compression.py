"""Compression reward: Mem-α's shaping terms (Wang et al. 2025, Mem-α: Learning Memory Construction via
Reinforcement Learning, arXiv:2509.25911).

Mem-α rewards a memory-building trajectory with ``r = r1 + r2 + β·r3 + γ·r4``: ``r1`` the accuracy
of a frozen answerer on the task's questions from the built memory, ``r2`` the tool-call format
reward (the fraction of the memory operations that executed), ``r3 = 1 − l_memory / l_context``
(compression), ``r4`` an LLM judge's verdict on the operations' content; β = 0.05, γ = 0.1.
"""

from __future__ import annotations

from lightning_memrl.rewards import RewardFunction
from lightning_memrl.types import MEMORY_TURN, Trajectory

OPERATIONS = "memory_operations"  # trajectory.info key: memory operations the workflow attempted
VALID_OPERATIONS = "valid_memory_operations"  # trajectory.info key: those that were valid and applied


def words(text: str) -> int:
    """Number of whitespace-separated words of ``text``."""
    return len(text.split())


def valid_operation_fraction(trajectory: Trajectory) -> float:
    """Fraction of the trajectory's memory operations that were valid.

    Read from ``trajectory.info[OPERATIONS]`` and ``info[VALID_OPERATIONS]`` when the workflow
    records them; otherwise every memory turn that wrote a memory text counts as one valid write
    (MemAgent: a memory turn's whole response is the new memory, nothing can fail to parse).
    0.0 when there was no operation.
    """
    if OPERATIONS in trajectory.info:
        total = int(trajectory.info[OPERATIONS])
        return int(trajectory.info.get(VALID_OPERATIONS, 0)) / total if total else 0.0
    writes = sum(turn.kind == MEMORY_TURN for turn in trajectory.turns)
    return 1.0 if writes else 0.0


class CompressionReward(RewardFunction):
    """Mem-α's compression and operation-validity terms (arXiv:2509.25911), the accuracy term left out.

    As implemented, for one trajectory::

        score = w_c · (1 − |memory| / |context|) + w_f · valid_operation_fraction

    ``|memory|`` is the word count of the final memory (``trajectory.memories[-1]``) and
    ``|context|`` that of the chunks the agent read (``trajectory.chunks``), both in
    whitespace-separated words (a reward sees text, not tokens; the ratio of the two is what
    matters). The compression term is not clipped: a memory longer than the context scores below 0.
    ``valid_operation_fraction`` is ``info["valid_memory_operations"] / info["memory_operations"]``
    where the workflow records them, else 1.0 when the trajectory has memory turns (MemAgent: every
    memory turn is a valid write). The paper's ``r1`` (answer accuracy) is the existing answer
    reward: stack this with ``ExactMatch`` (or ``TokenF1``) in ``model.init_args.rewards``; the
    LLM-judged content term ``r4`` is not implemented. ``weight`` multiplies the whole score, as for
    every reward function; the paper's weights are ``compression_weight`` (β = 0.05) and
    ``format_weight`` (``r2`` enters the paper's sum with weight 1).

    A trajectory whose workflow records no memory text (a memory-bank workflow: Memory-R1, RMM)
    cannot be scored: the first such trajectory stops the run with an error naming its task.
    Logged as ``train/reward/<name>`` (default ``compression``).

    Args:
        compression_weight: ``w_c``.
        format_weight: ``w_f``.
        weight: weight of this function in the reward sum.
        name: log key.
    """

    default_name = "compression"

    def __init__(
        self,
        compression_weight: float = 0.05,
        format_weight: float = 1.0,
        weight: float = 1.0,
        name: str | None = None,
    ) -> None:
        super().__init__(weight, name)
        self.compression_weight, self.format_weight = compression_weight, format_weight

    def score(self, trajectory: Trajectory) -> float | None:
        if not trajectory.memories:
            raise ValueError(
                f"reward {self.name} (CompressionReward): trajectory of task {trajectory.task.id!r} records no memory "
                "text (trajectory.memories is empty), so its memory size cannot be measured; it needs a workflow "
                "whose memory turns write a memory text (MemAgentWorkflow). Remove this reward for a memory-bank "
                "workflow."
            )
        context = sum(words(chunk) for chunk in trajectory.chunks)
        if context == 0:
            return None  # nothing was read: no compression to measure (unscored, left out of the baseline)
        compression = 1.0 - words(trajectory.memories[-1]) / context
        return self.compression_weight * compression + self.format_weight * valid_operation_fraction(trajectory)
