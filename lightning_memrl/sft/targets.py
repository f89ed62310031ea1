"""Supervised targets for Memory-R1's three agents, built from LoCoMo's own annotations.

LoCoMo annotates every session with ``session_N_observation``: facts about each speaker, each with
the dialogue turns (``dia_id``) it comes from. From them, with the prompts the RL stage uses
(:meth:`MemoryR1Workflow.extract_prompt`, :meth:`~MemoryR1Workflow.manage_prompt`,
:meth:`~lightning_memrl.workflows.bank.BankWorkflow.answer_prompt`):

- **extractor** (``extract``): per segment (:meth:`MemoryR1Workflow.segments`), the facts whose first
  evidence turn lies in it, in turn order, at most ``max_facts``, one line each ``[D1:3] fact``.
- **manager** (``manage``): per fact, against the bank built so far from the annotated facts (every fact
  of a segment sees the bank as it was at the segment's start, as in the RL rollout), ``NOOP`` when a
  shown memory already says the same (same words, ignoring case and spacing), else ``ADD`` of the fact.
  LoCoMo marks no contradictions, so the targets hold no UPDATE or DELETE.
- **answer agent** (``answer``): per question, the ids of the shown memories that cite one of its
  evidence turns, then the gold answer: ``Memories: m1, m4\\nAnswer: \\boxed{gold}``.

Facts citing no turn of their session and facts beyond ``max_facts`` of a segment are counted and logged.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.memory.bank import MemoryBank
from lightning_memrl.memory.operations import parse_memory_operation
from lightning_memrl.types import Task
from lightning_memrl.workflows.bank import Segment
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow

log = logging.getLogger(__name__)


PARTS = ("extract", "manage", "answer")


@dataclass
class SFTExample:
    """One prompt and the completion the model learns to write after it."""

    part: str  # extract | manage | answer
    prompt: str
    target: str
    system_prompt: str | None = None
    source: str = ""  # where it comes from, e.g. "conv-26 D1:3" (for logs and tests)
    meta: dict[str, Any] = field(default_factory=dict)  # manage: the fact and the ids of the memories shown


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def segment_facts(
    segment: Segment, max_facts: int, counts: Counter[str], cited: set[str] | None = None
) -> list[tuple[str, list[str]]]:
    """The annotated facts of ``segment`` (first evidence turn in it), in turn order, at most ``max_facts``.

    Args:
        segment: a segment of a parsed conversation.
        max_facts: facts kept per segment (the extractor's cap); more are counted as ``facts_over_max_facts``.
        counts: counters updated in place.
        cited: when given, the ids of facts placed in some segment are added to it (for the uncited count).
    """
    order = {dia_id: i for i, dia_id in enumerate(segment.source_ids)}
    mine = [(fact, ids) for fact, ids in segment.session.observations if ids and ids[0] in order]
    mine.sort(key=lambda item: order[item[1][0]])  # stable: facts of one turn keep their file order
    if cited is not None:
        cited.update(f"{segment.session.index}:{fact}" for fact, _ in mine)
    counts["facts_over_max_facts"] += max(len(mine) - max_facts, 0)
    return [(fact, [i for i in ids if i in order] or ids[:1]) for fact, ids in mine[:max_facts]]


def extract_target(facts: list[tuple[str, list[str]]]) -> str:
    """The extractor's completion: one ``[D1:3] fact`` line per fact (``none`` when there is none)."""
    return "\n".join(f"{''.join(f'[{i}]' for i in ids)} {fact}" for fact, ids in facts) or "none"


def manager_target(fact: str, shown_texts: list[str]) -> str:
    """``{"op": "NOOP"}`` when a shown memory already says ``fact``, else ``{"op": "ADD", "text": fact}``."""
    if _norm(fact) in {_norm(t) for t in shown_texts}:
        return json.dumps({"op": "NOOP"})
    return json.dumps({"op": "ADD", "text": fact})


def answer_target(memory_ids: list[str], answer: str) -> str:
    """The answer agent's completion: the memory ids that hold the evidence, then the boxed gold answer."""
    return f"Memories: {', '.join(memory_ids) or 'none'}\nAnswer: \\boxed{{{answer}}}"


def _bank_examples(
    workflow: MemoryR1Workflow, conversation: Conversation, counts: Counter[str]
) -> tuple[MemoryBank, list[SFTExample], list[SFTExample]]:
    """The bank the annotated facts build, with the extractor's and the manager's examples."""
    bank = workflow.new_bank()
    extract, manage = [], []
    cited: set[str] = set()
    system = workflow.system_prompt
    for segment in workflow.segments(conversation):
        facts = segment_facts(segment, workflow.max_facts, counts, cited)
        where = f"{conversation.id} {segment.source_ids[0]}-{segment.source_ids[-1]}"
        extract.append(SFTExample("extract", workflow.extract_prompt(segment), extract_target(facts), system, where))
        jobs = []
        for fact, sources in facts:  # every fact of the segment sees the bank as it was at its start
            shown = [e for e, _ in bank.retrieve(fact, workflow.manager_top_k)]
            target = manager_target(fact, [e.text for e in shown])
            prompt = workflow.manage_prompt(bank, shown, fact, segment)
            meta = {"fact": fact, "shown_ids": [e.id for e in shown]}
            manage.append(SFTExample("manage", prompt, target, system, f"{conversation.id} {sources[0]}", meta))
            jobs.append((target, {e.id for e in shown}, fact, sources))
        for target, shown_ids, fact, sources in jobs:
            parsed = parse_memory_operation(target, shown_ids, fact)  # the RL stage's parser and bank rules
            counts[parsed.op.value] += 1
            bank.apply(
                parsed.op, parsed.text, parsed.target_id, segment.session.name, segment.session.date_time, sources
            )
    for session in conversation.sessions:
        counts["facts_without_turn"] += sum(f"{session.index}:{f}" not in cited for f, _ in session.observations)
    return bank, extract, manage


def build_sft_examples(
    workflow: MemoryR1Workflow, tasks: list[Task], parts: tuple[str, ...] | list[str] = PARTS
) -> tuple[list[SFTExample], Counter[str]]:
    """Memory-R1's supervised examples for the conversations of ``tasks`` (LoCoMo questions).

    Args:
        workflow: the Memory-R1 workflow whose prompts, segments, caps and retriever the RL stage uses.
        tasks: LoCoMo tasks (``load_locomo``); their conversations give the extractor and manager
            examples, the tasks themselves the answer examples.
        parts: which agents' examples to build (``extract``, ``manage``, ``answer``).

    Returns:
        The examples (per conversation: extractor, manager, answer) and counts of what was built or skipped.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"sft parts must be among {list(PARTS)}, got {unknown}")
    by_conversation: dict[str, list[Task]] = {}
    conversations: dict[str, Conversation] = {}
    for task in tasks:
        conversation = task.meta["conversation"]
        conversations.setdefault(conversation.id, conversation)
        by_conversation.setdefault(conversation.id, []).append(task)
    examples: list[SFTExample] = []
    counts: Counter[str] = Counter()
    for cid, conversation in conversations.items():
        bank, extract, manage = _bank_examples(workflow, conversation, counts)
        answers = []
        for task in by_conversation[cid]:
            shown = [e for e, _ in bank.retrieve(task.question, workflow.answer_top_k)]
            evidence = set(task.meta.get("evidence", []))
            ids = [e.id for e in shown if evidence & set(e.source_ids)]
            counts["answers_without_evidence_memory"] += not ids
            prompt = workflow.answer_prompt(task.question, conversation, bank.format(shown, empty="(no memories)"))
            answers.append(
                SFTExample("answer", prompt, answer_target(ids, task.answers[0]), workflow.system_prompt, task.id)
            )
        chosen = {"extract": extract, "manage": manage, "answer": answers}
        examples += [e for part in PARTS if part in parts for e in chosen[part]]
    counts.update(Counter(e.part for e in examples))
    if counts["facts_without_turn"] or counts["facts_over_max_facts"]:
        log.info(
            "SFT targets: %d annotated facts cite no turn of their session, %d exceed max_facts of their segment "
            "(left out)",
            counts["facts_without_turn"],
            counts["facts_over_max_facts"],
        )
    log.info("SFT targets from %d conversations: %s", len(conversations), dict(counts))
    return examples, counts
