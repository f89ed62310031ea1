"""Memory-R1 (arXiv:2508.19828): a fact extractor, a memory manager (one ADD/UPDATE/DELETE/NOOP per fact),
an answer agent.

For every segment of a conversation the extractor lists facts; for each fact the manager sees the
memories retrieved for it and picks one operation, which is applied to the bank. The answer agent
sees the memories retrieved for the question, writes the ids of those it uses (memory
distillation) and then the answer. Training stages (``stage``):

- ``manager``: manager turns are trained; the answer agent is frozen, so the reward (e.g. exact
  match of its answer) judges the bank the manager built, by a judge that does not change.
- ``answerer``: the answer turn is trained (reward EM/F1); extractor and manager are frozen, so
  each conversation's bank is built once, greedily, and cached.

A frozen agent (and the extractor unless ``train_extractor``) generates greedily with the
workflow's ``frozen_engine`` (see :mod:`lightning_memrl.workflows.bank`), a model that does not
train: its facts and banks are the same at every step, and a log line names the model that built
them. With ``train_extractor`` the extractor is the policy: its validation facts are cached only
until the next training rollout.

A manager output that names no usable operation is a NOOP with a format penalty on that turn
(``turn.reward = -format_penalty``); it is counted, logged, and never stops the run. All turns are
ordinary multi-turn rollout turns, trained by ``MemRLModule``'s GRPO with the trajectory's advantage.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.errors import check_placeholders
from lightning_memrl.memory.bank import MemoryBank, MemoryBankError, MemoryEntry, MemoryOp
from lightning_memrl.memory.operations import parse_memory_operation
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import MEMORY_TURN, RolloutBatch, Trajectory, Turn
from lightning_memrl.workflows.bank import (
    BankWorkflow,
    Segment,
    answer_part,
    parse_items,
    record_shown,
)

log = logging.getLogger(__name__)


EXTRACT_TURN = "extract"


DEFAULT_EXTRACT_TEMPLATE = (
    "Here is part of a conversation ({date}):\n{dialogue}\n\n"
    "List at most {max_facts} facts worth remembering about the speakers, one per line, each a short "
    "sentence with names and dates, starting with the turn it comes from, e.g.\n"
    "[D1:3] Caroline went to a support group on 7 May 2023."
)


DEFAULT_MANAGE_TEMPLATE = (
    "You manage a memory bank. Memories related to a new fact:\n{memories}\n\nNew fact ({date}): {fact}\n\n"
    "Choose one operation: ADD (store the fact as a new memory), UPDATE (rewrite a listed memory so it "
    "includes the fact), DELETE (the fact shows a listed memory is wrong) or NOOP (nothing new). "
    'Reply with JSON only, e.g. {{"op": "ADD", "text": "..."}} or {{"op": "UPDATE", "id": "m3", "text": "..."}}.'
)


DEFAULT_ANSWER_TEMPLATE = (
    "Memories from a conversation between {speaker_a} and {speaker_b}:\n{memories}\n\nQuestion: {question}\n\n"
    "First write the ids of the memories that answer the question, then a short answer:\n"
    "Memories: m1, m2\nAnswer: \\boxed{{answer}}"
)


_MEMORY_ID = re.compile(r"\bm\d+\b")


class MemoryR1Workflow(BankWorkflow):
    """Memory-R1 on LoCoMo conversations (see the module docstring).

    Args:
        stage: ``manager`` (train the memory manager against a frozen answer agent) or
            ``answerer`` (train the answer agent on frozen banks).
        max_facts: facts kept per segment.
        manager_top_k: memories retrieved for each fact and shown to the manager.
        answer_top_k: memories retrieved for the question and shown to the answer agent.
        extract_max_tokens: generation cap of an extraction turn.
        manage_max_tokens: generation cap of a manager turn.
        format_penalty: subtracted from a manager turn whose output is not a usable operation.
        train_extractor: also train the extraction turns (stage ``manager`` only).
        extract_template: prompt with ``{date}``, ``{dialogue}``, ``{max_facts}``.
        manage_template: prompt with ``{memories}``, ``{fact}``, ``{date}``.
        answer_template: prompt of the answer agent (see :class:`BankWorkflow`).
        **kwargs: ``retriever``, ``turns_per_segment`` (dialogue turns the extractor reads per call,
            default 8), ``max_batch``, ``system_prompt``, ``judge`` of :class:`BankWorkflow`.
    """

    records_memory_writes = True  # manager turns note turn.info["wrote_entries"]

    def __init__(
        self,
        stage: str = "manager",
        max_facts: int = 4,
        manager_top_k: int = 5,
        answer_top_k: int = 10,
        extract_max_tokens: int = 96,
        manage_max_tokens: int = 64,
        format_penalty: float = 0.1,
        train_extractor: bool = False,
        extract_template: str = DEFAULT_EXTRACT_TEMPLATE,
        manage_template: str = DEFAULT_MANAGE_TEMPLATE,
        answer_template: str = DEFAULT_ANSWER_TEMPLATE,
        **kwargs: Any,
    ) -> None:
        super().__init__(answer_template, **kwargs)
        if stage not in ("manager", "answerer"):
            raise ValueError(f"workflow stage must be 'manager' or 'answerer', got {stage!r}")
        for name, value in (("max_facts", max_facts), ("manager_top_k", manager_top_k), ("answer_top_k", answer_top_k)):
            if value < 1:
                raise ValueError(f"workflow {name} must be >= 1, got {value}")
        check_placeholders(
            ("extract_template", extract_template, ("{dialogue}",)),
            ("manage_template", manage_template, ("{memories}", "{fact}")),
        )
        self.stage = stage
        self.max_facts, self.manager_top_k, self.answer_top_k = max_facts, manager_top_k, answer_top_k
        self.extract_max_tokens, self.manage_max_tokens = extract_max_tokens, manage_max_tokens
        self.format_penalty = format_penalty
        self.train_extractor = train_extractor and stage == "manager"
        self.extract_template, self.manage_template = extract_template, manage_template
        # greedy facts per conversation: the frozen model's (kept), or the trained extractor's (until it trains)
        self._facts_cache: dict[str, list[list[tuple[str, list[str]]]]] = {}
        self._step_counts: Counter[str] = Counter()  # counts of the last training rollout
        self._valid_ops: dict[str, float | None] = {}  # conversation id -> valid-operation rate of its greedy bank

    def banks_are_frozen(self) -> bool:
        return self.stage == "answerer"

    def needs_frozen_model(self) -> bool:
        """Always: the answer agent (stage manager) or the extractor and manager (answerer) are frozen."""
        return True

    def policy_will_change(self) -> None:
        """Also drop the extractor's cached facts when the extractor is the policy being trained."""
        super().policy_will_change()
        if self.train_extractor:
            self._facts_cache.clear()

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        return max(settings.max_new_tokens, self.manage_max_tokens, self.extract_max_tokens)

    # ------------------------------------------------------------------ prompts
    def extract_prompt(self, segment: Segment) -> str:
        """The extractor's prompt for one segment."""
        return self.extract_template.format(
            date=segment.session.date_time, dialogue=segment.text, max_facts=self.max_facts
        )

    def manage_prompt(self, bank: MemoryBank, shown: list[MemoryEntry], fact: str, segment: Segment) -> str:
        """The manager's prompt for ``fact``, showing the ``shown`` entries of ``bank``."""
        return self.manage_template.format(
            memories=bank.format(shown, empty="(none)"), fact=fact, date=segment.session.date_time
        )

    # ------------------------------------------------------------------ extraction
    def extract(
        self, engine: RolloutBackend, conversations: list[Conversation], settings: GenerationSettings, trainable: bool
    ) -> tuple[list[list[list[tuple[str, list[str]]]]], list[list[Turn]]]:
        """Facts per conversation per segment (``(fact, source dia_ids)``) and the extraction turns.

        Outside a training rollout the extractor runs greedily once per conversation (cached) and
        adds no turns: with the frozen model unless ``train_extractor``.
        """
        todo = conversations if trainable else [c for c in {c.id: c for c in conversations}.values()]
        todo = [c for c in todo if trainable or c.id not in self._facts_cache]
        jobs = [(i, seg) for i, c in enumerate(todo) for seg in self.segments(c)]
        texts = [self.extract_prompt(seg) for _, seg in jobs]
        gen_settings = settings if trainable else settings.greedy()
        engine = self.engine_for(engine, self.train_extractor)
        if todo and not trainable:
            log.info("Memory-R1: facts of %d conversations extracted by %s", len(todo), self.describe(engine))
        turns = self.generate_turns(engine, texts, gen_settings, self.extract_max_tokens, EXTRACT_TURN, trainable)
        facts: list[list[list[tuple[str, list[str]]]]] = [[] for _ in todo]
        turns_of: list[list[Turn]] = [[] for _ in todo]
        uncited: Counter[str] = Counter()
        for (i, seg), turn in zip(jobs, turns):
            facts[i].append(parse_items(turn.text, seg.source_ids, self.max_facts, uncited, self.extract_template))
            turns_of[i].append(turn)
        if uncited["uncited"]:
            self.counters["facts_without_turn_id"] += uncited["uncited"]
            log.info("extractor: %d facts cite no turn id (credited with their whole segment)", uncited["uncited"])
        if uncited["copied"]:
            self.counters["facts_copied_from_prompt"] += uncited["copied"]
            log.warning("extractor: %d facts repeat the prompt's own words (dropped)", uncited["copied"])
        if trainable:
            return facts, turns_of
        for conversation, conv_facts in zip(todo, facts):
            self._facts_cache[conversation.id] = conv_facts
        return [self._facts_cache[c.id] for c in conversations], [[] for _ in conversations]

    # ------------------------------------------------------------------ the memory manager
    def build_banks(
        self, engine: RolloutBackend, conversations: list[Conversation], settings: GenerationSettings, trainable: bool
    ) -> list[tuple[MemoryBank, list[Turn]]]:
        manager_trainable = trainable and self.stage == "manager"
        facts, turns = self.extract(engine, conversations, settings, trainable and self.train_extractor)
        segments = [self.segments(c) for c in conversations]
        banks = [self.new_bank() for _ in conversations]
        counts: Counter[str] = Counter()
        gen_settings = settings if manager_trainable else settings.greedy()
        manager = self.engine_for(engine, self.stage == "manager")
        outcomes: list[Counter[bool]] = [Counter() for _ in conversations]  # per bank: valid (True) / not
        for r in range(max((len(s) for s in segments), default=0)):
            jobs = []  # (slot, fact, source ids, ids shown) in application order
            texts = []
            for slot, conv_segments in enumerate(segments):
                if r >= len(conv_segments):
                    continue
                segment = conv_segments[r]
                for fact, sources in facts[slot][r]:
                    shown = [e for e, _ in banks[slot].retrieve(fact, self.manager_top_k)]
                    jobs.append((slot, segment, fact, sources, {e.id for e in shown}))
                    texts.append(self.manage_prompt(banks[slot], shown, fact, segment))
            counts["facts"] += len(jobs)
            outputs = self.generate_turns(
                manager, texts, gen_settings, self.manage_max_tokens, MEMORY_TURN, manager_trainable
            )
            for (slot, segment, fact, sources, shown_ids), turn in zip(jobs, outputs):
                invalid = counts["invalid"]
                self.apply_operation(banks[slot], turn, segment, fact, sources, shown_ids, counts)
                outcomes[slot][counts["invalid"] == invalid] += 1
                turns[slot].append(turn)
        self.counters.update(counts)
        if trainable:
            self._step_counts = counts
        else:  # greedy banks (evaluation, frozen banks): each one's valid-operation rate, for the report
            for conversation, outcome in zip(conversations, outcomes):
                total = outcome[True] + outcome[False]
                self._valid_ops[conversation.id] = outcome[True] / total if total else None
        if counts["invalid"]:
            log.warning(
                "memory manager: %d of %d outputs were not a usable operation (NOOP, penalty %.2f)",
                counts["invalid"],
                counts["facts"],
                self.format_penalty,
            )
        log.info(
            "memory manager (%s) over %d conversations: %s", self.describe(manager), len(conversations), dict(counts)
        )
        return list(zip(banks, turns))

    def apply_operation(
        self,
        bank: MemoryBank,
        turn: Turn,
        segment: Segment,
        fact: str,
        sources: list[str],
        shown_ids: set[str],
        counts: Counter[str],
    ) -> None:
        """Apply the operation a manager ``turn`` chose for ``fact`` to ``bank``, counted in ``counts``.

        An output that names no usable operation is a NOOP whose turn gets ``-format_penalty``. An ADD or
        UPDATE notes the entry it wrote in ``turn.info["wrote_entries"]`` (``{id: text}``), the link from a
        bank entry to the turn that wrote it (used by evidence-anchored credit).
        """
        parsed = parse_memory_operation(turn.text, shown_ids, fact)
        if not parsed.valid:
            counts["invalid"] += 1
            turn.reward = -self.format_penalty
        else:
            session = segment.session
            try:
                entry = bank.apply(parsed.op, parsed.text, parsed.target_id, session.name, session.date_time, sources)
                if entry is not None and parsed.op in (MemoryOp.ADD, MemoryOp.UPDATE):
                    turn.info["wrote_entries"] = {entry.id: entry.text}
            except MemoryBankError:  # the target was deleted by an earlier fact of this round
                counts["stale_target"] += 1
        counts[parsed.op.value] += 1

    # ------------------------------------------------------------------ the answer agent
    def answer_is_trained(self) -> bool:
        return self.stage == "answerer"  # stage manager: the frozen model answers, never the policy

    def show_memories(self, trajectories: list[Trajectory], banks: list[MemoryBank], training: bool) -> list[str]:
        """The ``answer_top_k`` memories retrieved for each question."""
        rendered = []
        for trajectory, bank in zip(trajectories, banks):
            shown = [e for e, _ in bank.retrieve(trajectory.task.question, self.answer_top_k)]
            record_shown(trajectory, shown)
            rendered.append(bank.format(shown, empty="(no memories)"))
        return rendered

    def read_answer(self, trajectory: Trajectory, response: str) -> str:
        """The answer without the memory list; the listed ids that were shown go to ``info["selected_ids"]``."""
        head = response[: response.lower().rfind("answer:")] if "answer:" in response.lower() else ""
        shown = set(trajectory.info["shown_ids"])
        trajectory.info["selected_ids"] = [i for i in dict.fromkeys(_MEMORY_ID.findall(head)) if i in shown]
        return answer_part(response)

    # ------------------------------------------------------------------ metrics and state
    def step_metrics(self, rollouts: RolloutBatch) -> dict[str, float]:
        """The manager's operation mix and invalid-output rate of the last training rollout (taken)."""
        counts, self._step_counts = self._step_counts, Counter()
        if not counts:
            return {}
        facts = max(counts["facts"], 1)
        metrics = {f"manager/{op.lower()}_frac": counts[op] / facts for op in ("ADD", "UPDATE", "DELETE", "NOOP")}
        metrics["manager/invalid_frac"] = counts["invalid"] / facts
        metrics["manager/facts"] = float(counts["facts"])
        return metrics

    def evaluation_metrics(self, trajectory: Trajectory) -> dict[str, float | None]:
        """Also ``valid_operations``: the share of the manager's outputs that were usable operations
        when the (greedy) bank this question was answered from was built."""
        metrics = super().evaluation_metrics(trajectory)
        conversation = trajectory.task.meta.get("conversation")  # None: no bank was built for this task
        metrics["valid_operations"] = self._valid_ops.get(conversation.id) if conversation is not None else None
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "facts": self._facts_cache, "valid_operations": self._valid_ops}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._valid_ops = dict(state.get("valid_operations", {}))
        self._facts_cache = {
            cid: [[(f, list(s)) for f, s in seg] for seg in conv] for cid, conv in state.get("facts", {}).items()
        }
