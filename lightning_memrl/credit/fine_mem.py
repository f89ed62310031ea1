"""Fine-Mem's chunk-level step reward and evidence-anchored reward attribution for memory writes.

Fine-Mem (arXiv:2601.08435) gives each memory operation a step reward from an auxiliary check after
the update (Chunk-level Step Reward, CSR) and redistributes the trajectory's reward onto the
operations that wrote the memory items the final answer used as evidence (Evidence-Anchored Reward
Attribution, EARA; its normalised evidence contribution is
``N_t = sum_j sum_{m in M_j, phi(m) = t} s_j / (|M_j| * n)`` over ``n`` questions, with ``M_j`` the
items used for question ``j``, ``s_j`` its score and ``phi(m)`` the step that wrote ``m``).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.answer_presence import holds_answer
from lightning_memrl.credit.memory_turns import mix_memory_advantages, values_on_rows
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import MEMORY_TURN, RolloutBatch, Trajectory


def used_entry_ids(trajectory: Trajectory) -> list[str]:
    """Ids of the bank entries the final answer used: Memory-R1's ``selected_ids``, RMM's ``cited`` positions."""
    info = trajectory.info
    if "selected_ids" in info:
        return list(dict.fromkeys(info["selected_ids"]))
    shown = info.get("shown_ids", [])
    return list(dict.fromkeys(shown[p] for p in info.get("cited", []) if 0 <= p < len(shown)))


def fine_mem_terms(trajectory: Trajectory, reward: float) -> tuple[list[float], list[float], list[bool]]:
    """Step reward ``s_t``, evidence reward ``N_t`` and evidence flag of each memory turn of ``trajectory``.

    Text memory (``memories[t]`` written after ``chunks[t]``): ``s_t = 1[m_t holds a gold answer]``;
    the evidence turns are those whose chunk held a gold answer, and ``N_t = R / |evidence|`` on each.
    Memory bank (turns noting ``info["wrote_entries"]``): ``s_t = 1[the entry text turn t wrote holds a
    gold answer]``; for the entries ``U`` the answer used, ``N_t = R * sum_{m in U, t wrote m} 1 / (|U| *
    |writers(m)|)`` (Fine-Mem's ``N_t`` for one question, an entry's share split among the turns that
    added or updated it; a used entry no turn of the trajectory wrote keeps its share).

    Args:
        trajectory: one trajectory.
        reward: its (shaped) reward ``R``.
    """
    answers = trajectory.task.answers
    memory_turns = [t for t in trajectory.turns if t.kind == MEMORY_TURN]
    if any("wrote_entries" in t.info for t in memory_turns) or "shown_ids" in trajectory.info:
        writes = [t.info.get("wrote_entries", {}) for t in memory_turns]
        steps = [float(any(holds_answer(text, answers) for text in w.values())) for w in writes]
        used = used_entry_ids(trajectory)
        writers = {m: [k for k, w in enumerate(writes) if m in w] for m in used}
        shares = [sum(1 / (len(used) * len(writers[m])) for m in used if m in w) for w in writes]
        return steps, [reward * s for s in shares], [s > 0 for s in shares]
    steps = [float(holds_answer(m, answers)) for m in trajectory.memories]
    evidence = [holds_answer(c, answers) for c in trajectory.chunks[: len(trajectory.memories)]]
    count = sum(evidence)
    return steps, [reward / count if e else 0.0 for e in evidence], evidence


class FineMemCredit(MemRLCallback):
    """Fine-Mem (arXiv:2601.08435): a per-memory-turn reward from CSR and EARA on memory-turn tokens.

    Formula as implemented, for memory turn ``t`` of trajectory ``i`` with reward ``R_i``
    (see :func:`fine_mem_terms` for ``s`` and ``N``):

    - step reward ``s_t`` (CSR): does the memory now answer the question? Fine-Mem asks a reasoning
      model auxiliary per-chunk questions; here the check is gold-answer presence
      (:func:`~lightning_memrl.credit.answer_presence.holds_answer`) in the updated memory (MemAgent)
      or in the entry the operation wrote (Memory-R1).
    - evidence reward ``N_t`` (EARA): ``R_i`` redistributed onto the writes the answer used as
      evidence: MemAgent's turns whose chunk held the gold answer; a bank's operations that wrote the
      entries the answer selected (Memory-R1 ``selected_ids``) or cited (RMM ``cited``).
    - turn reward ``r_t = step_weight * s_t + evidence_weight * N_t``; turn advantage
      ``Â_t = r_t - mean(r over the memory turns of i's group)``;
    - on generated tokens of memory turns ``A = (1 - weight) * A_trajectory + weight * Â_t``;
      answer turns keep ``A_trajectory``.

    Serves MemAgent (``Workflow.memory_per_chunk``) and bank workflows whose memory operations are
    trained (Memory-R1 stage ``manager``); it is refused at setup on a workflow whose memory turns are
    never trained (Memory-R1 stage ``answerer``, RMM: reflection is frozen) or that records neither a
    memory per chunk nor the entries its turns wrote. Logs ``train/fine_mem/step_reward`` (mean
    ``s``), ``train/fine_mem/evidence_reward`` (mean ``N``) and ``train/fine_mem/evidence_frac`` (share
    of memory turns that are evidence), over the step's trainable memory turns.

    Args:
        weight: share of the Fine-Mem turn advantage on memory tokens, in [0, 1].
        step_weight: weight of the CSR step reward (>= 0).
        evidence_weight: weight of the EARA evidence reward (>= 0).
    """

    def __init__(self, weight: float = 0.5, step_weight: float = 1.0, evidence_weight: float = 1.0) -> None:
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"FineMemCredit: weight must be in [0, 1], got {weight}")
        if step_weight < 0 or evidence_weight < 0:
            raise ValueError(
                f"FineMemCredit: step_weight and evidence_weight must be >= 0, got {step_weight}, {evidence_weight}"
            )
        self.weight, self.step_weight, self.evidence_weight = weight, step_weight, evidence_weight
        self.evidence_turns = 0  # lifetime counts, saved in checkpoints
        self.credited_turns = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow whose memory writes are never trained or cannot be linked to what they wrote."""
        workflow = getattr(pl_module, "workflow", None)
        if workflow is None or getattr(workflow, "memory_per_chunk", False):
            return
        banks_are_frozen = getattr(workflow, "banks_are_frozen", None)
        if (
            banks_are_frozen is not None
            and getattr(workflow, "records_memory_writes", False)
            and not banks_are_frozen()
        ):
            return
        raise ConfigError(
            f"FineMemCredit cannot serve {type(workflow).__name__}: it rewards each trained "
            "memory write by whether the memory it wrote holds the gold answer and by the evidence the answer "
            "used, which needs a memory per chunk (MemAgent) or trained bank operations that record the entries "
            "they wrote (Memory-R1 with stage: manager); here the memory writes are not trained or not recorded "
            "(Memory-R1 stage answerer and RMM build frozen banks). Remove the callback for this workflow."
        )

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        name = "FineMemCredit"
        terms = [fine_mem_terms(t, float(r)) for t, r in zip(rollouts.trajectories, rollouts.rewards)]
        turn_rewards = [
            [self.step_weight * s + self.evidence_weight * n for s, n in zip(steps, shares)]
            for steps, shares, _ in terms
        ]
        centred: list[list[float]] = []
        for start in range(0, len(turn_rewards), rollouts.group_size):
            group = turn_rewards[start : start + rollouts.group_size]
            flat = [r for rewards in group for r in rewards]
            mean = sum(flat) / len(flat) if flat else 0.0
            centred.extend([r - mean for r in rewards] for rewards in group)
        advantages = values_on_rows(rollouts, centred, name)  # [M]
        mix_memory_advantages(rollouts, advantages, self.weight)
        rows = rollouts.memory_turns
        if not bool(rows.any()):  # a batch without trainable memory turns logs nothing
            return
        steps = values_on_rows(rollouts, [s for s, _, _ in terms], name)[rows]
        shares = values_on_rows(rollouts, [n for _, n, _ in terms], name)[rows]
        evidence = values_on_rows(rollouts, [[float(e) for e in flags] for _, _, flags in terms], name)[rows]
        self.evidence_turns += int(evidence.sum())
        self.credited_turns += int(rows.sum())
        module.log("train/fine_mem/step_reward", float(steps.mean()))
        module.log("train/fine_mem/evidence_reward", float(shares.mean()))
        module.log("train/fine_mem/evidence_frac", float(evidence.mean()))

    def state_dict(self) -> dict[str, Any]:
        return {"evidence_turns": self.evidence_turns, "credited_turns": self.credited_turns}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evidence_turns = int(state_dict.get("evidence_turns", 0))
        self.credited_turns = int(state_dict.get("credited_turns", 0))
