"""HiMPO's memory-token credit: a write's local utility times a bounded hindsight relevance.

HiMPO (Hindsight-Informed Memory Policy Optimization, arXiv:2606.16285) credits each memory write
by what the updated memory lets one recover versus the previous memory, from the same pre-write
state (local utility), attenuated by a bounded retrospective filter (hindsight relevance). The
resulting memory advantage goes on memory-turn tokens only; the trajectory advantage trains the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import answer_word_recall, holds_answer
from lightning_memrl.credit.memory_turns import mix_memory_advantages, require_memory_per_chunk, values_on_rows
from lightning_memrl.types import RolloutBatch, Trajectory


def _presence(text: str, answers: list[str]) -> float:
    return float(holds_answer(text, answers))


RECOVERABILITY: dict[str, Callable[[str, list[str]], float]] = {
    "word_recall": answer_word_recall,  # fraction of a gold answer's words present
    "presence": _presence,  # 1 when a whole gold answer is present, else 0
}


HINDSIGHT = ("read_so_far", "chunk")


def himpo_terms(
    trajectory: Trajectory, recoverability: str = "word_recall", hindsight: str = "read_so_far", floor: float = 0.0
) -> tuple[list[float], list[float]]:
    """Local utility ``u_k`` and hindsight relevance ``h_k`` of each memory turn ``k`` of ``trajectory``.

    ``u_k = rec(m_k) - rec(m_{k-1})`` with ``m_{-1}`` the empty memory (``rec("") = 0``);
    ``h_k = min(1, max(floor, rel_k))`` with ``rel_k = rec(c_k)`` (``chunk``) or
    ``max_{j<=k} rec(c_j)`` (``read_so_far``), ``c_k`` the chunk turn ``k`` read.

    Args:
        trajectory: a trajectory whose ``memories[k]`` was written after reading ``chunks[k]``.
        recoverability: ``word_recall`` or ``presence`` (see :data:`RECOVERABILITY`).
        hindsight: ``read_so_far`` or ``chunk``.
        floor: lower bound of ``h_k`` in [0, 1].
    """
    rec = RECOVERABILITY[recoverability]
    answers = trajectory.task.answers
    utilities, relevances = [], []
    previous, seen = 0.0, 0.0
    for chunk, memory in zip(trajectory.chunks, trajectory.memories):
        current = rec(memory, answers)
        utilities.append(current - previous)
        previous = current
        chunk_relevance = rec(chunk, answers)
        seen = max(seen, chunk_relevance)
        relevance = seen if hindsight == "read_so_far" else chunk_relevance
        relevances.append(min(1.0, max(floor, relevance)))
    return utilities, relevances


class HindsightMemoryCredit(MemRLCallback):
    """HiMPO (arXiv:2606.16285): memory advantage ``c_k = u_k * h_k`` on memory-turn tokens.

    Formula as implemented, for memory turn ``k`` (memory ``m_k`` written after chunk ``c_k``):

    - local utility ``u_k = rec(m_k) - rec(m_{k-1})`` (``m_{-1}`` empty): what the updated memory
      recovers versus the previous one, from the same pre-write state. HiMPO scores recoverability
      with a model; here ``rec`` is the shared gold-answer check of
      :mod:`lightning_memrl.credit.answer_presence` (``word_recall``: :func:`answer_word_recall`;
      ``presence``: :func:`holds_answer` as 0/1), so the credit costs no model call.
    - hindsight relevance ``h_k = min(1, max(floor, rel_k))`` in [0, 1]: whether the evidence at stake
      turned out relevant to the answer; ``rel_k = rec(c_k)`` (``chunk``: the chunk written from) or
      ``max_{j<=k} rec(c_j)`` (``read_so_far``: any chunk read so far, so a write that drops evidence
      read earlier is still penalised). A gain not grounded in a read chunk (a guess) is filtered out.
    - on generated tokens of memory turns ``A = (1 - weight) * A_trajectory + weight * c_k``; answer
      turns keep ``A_trajectory``. ``weight`` 1.0 (default) is HiMPO's split: memory tokens get the
      memory advantage alone.

    How it differs from :class:`~lightning_memrl.callbacks.MemoryTokenCredit`: that callback credits
    the *level* of the memory (+1 holds the answer, -1 lost it after a chunk held it, 0 nothing read
    yet), so a turn that copies a good memory earns +1; this one credits the *change* a write made,
    so copying earns 0 and only the write that captured (or dropped) the answer is credited.

    Works with workflows whose memory turn ``k`` writes ``trajectory.memories[k]`` after reading
    ``trajectory.chunks[k]`` (``Workflow.memory_per_chunk``: MemAgent); others are refused at setup.
    Logs ``train/himpo/credit``, ``train/himpo/utility`` and ``train/himpo/relevance`` (means over
    the step's trainable memory turns).

    Args:
        weight: share of the memory advantage on memory tokens, in [0, 1].
        recoverability: ``word_recall`` or ``presence``.
        hindsight: ``read_so_far`` or ``chunk``.
        relevance_floor: lower bound of ``h_k`` in [0, 1] (0: a write with no relevant chunk gets no credit).
    """

    def __init__(
        self,
        weight: float = 1.0,
        recoverability: str = "word_recall",
        hindsight: str = "read_so_far",
        relevance_floor: float = 0.0,
    ) -> None:
        for name, value in (("weight", weight), ("relevance_floor", relevance_floor)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"HindsightMemoryCredit: {name} must be in [0, 1], got {value}")
        if recoverability not in RECOVERABILITY:
            raise ValueError(
                f"HindsightMemoryCredit: recoverability must be one of {sorted(RECOVERABILITY)}, got {recoverability!r}"
            )
        if hindsight not in HINDSIGHT:
            raise ValueError(f"HindsightMemoryCredit: hindsight must be one of {list(HINDSIGHT)}, got {hindsight!r}")
        self.weight, self.recoverability, self.hindsight = weight, recoverability, hindsight
        self.relevance_floor = relevance_floor
        self.credit_sum = 0.0  # lifetime sums, saved in checkpoints
        self.credited_turns = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow whose memory turns do not each write one memory text after one chunk."""
        require_memory_per_chunk(
            "HindsightMemoryCredit",
            getattr(pl_module, "workflow", None),
            "it compares the memory each memory turn wrote (trajectory.memories[k]) with the previous one and "
            "weighs it by the chunk it read (trajectory.chunks[k])",
        )

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        terms = [
            himpo_terms(t, self.recoverability, self.hindsight, self.relevance_floor) for t in rollouts.trajectories
        ]
        name = "HindsightMemoryCredit"
        utility = values_on_rows(rollouts, [u for u, _ in terms], name)  # [M]
        relevance = values_on_rows(rollouts, [h for _, h in terms], name)  # [M]
        credits = utility * relevance  # [M], 0 on answer rows
        mix_memory_advantages(rollouts, credits, self.weight)
        rows = rollouts.memory_turns
        if not bool(rows.any()):  # a batch without trainable memory turns logs nothing
            return
        self.credit_sum += float(credits[rows].sum())
        self.credited_turns += int(rows.sum())
        module.log("train/himpo/credit", float(credits[rows].mean()))
        module.log("train/himpo/utility", float(utility[rows].mean()))
        module.log("train/himpo/relevance", float(relevance[rows].mean()))

    def state_dict(self) -> dict[str, Any]:
        return {"credit_sum": self.credit_sum, "credited_turns": self.credited_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.credit_sum = float(state_dict.get("credit_sum", 0.0))
        self.credited_turns = int(state_dict.get("credited_turns", 0))
