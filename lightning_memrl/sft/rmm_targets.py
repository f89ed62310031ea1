"""Supervised targets for RMM's generator: answer, then cite the shown memories that hold the evidence.

RMM (arXiv:2503.08026) trains its reranker from the generator's citations: +1 for a shown memory the
answer cites, −1 for one it does not. That reward only varies when the generator writes citations and
writes them about the memories' content; SmolLM2-135M-Instruct rarely follows the answer format at all.
This warm start teaches it, as Memory-R1's Memory-SFT teaches its agents, from LoCoMo's own annotations:

- the bank holds each session's annotated ``observation`` facts as memories, with their evidence turns as
  source ids (RMM's memory = a summary plus the raw turns it came from);
- per question, the first stage's top ``top_m`` of that bank are shown in a random order (as the RL
  stage shows them while training, ``shuffle_shown``), rendered by :meth:`RMMWorkflow.render_memory` in
  the RL stage's own prompt (:meth:`~lightning_memrl.workflows.bank.BankWorkflow.answer_prompt`);
- the target is ``Answer: \\boxed{gold}`` then ``Citations: [j, ...]``: the displayed numbers of the shown
  memories whose source turns include one of the question's evidence turns (``Citations: []`` when none).

The citations are taught from the evidence annotations of the training conversations only; what the
generator then cites on other conversations is its own reading of the memories.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.memory.bank import MemoryBank
from lightning_memrl.sft.targets import SFTExample
from lightning_memrl.types import Task
from lightning_memrl.workflows.rmm import RMMWorkflow
from lightning_memrl.workflows.rmm_reranker import shown_order

log = logging.getLogger(__name__)


def observation_bank(workflow: RMMWorkflow, conversation: Conversation) -> MemoryBank:
    """A bank of the conversation's annotated facts, one memory each, sources = their evidence turns."""
    bank = workflow.new_bank()
    for session in conversation.sessions:
        for fact, ids in session.observations:
            bank.add(fact, session.name, session.date_time, list(ids))
    return bank


def cited_answer_target(answer: str, cited: list[int]) -> str:
    """``Answer: \\boxed{answer}`` and the 1-based displayed numbers cited, in RMM's answer format."""
    return f"Answer: \\boxed{{{answer}}}\nCitations: [{', '.join(str(n) for n in cited)}]"


def build_rmm_answer_examples(
    workflow: RMMWorkflow, tasks: list[Task], seed: int = 0
) -> tuple[list[SFTExample], Counter[str]]:
    """RMM generator examples for the questions of ``tasks`` (see the module docstring).

    Args:
        workflow: the RMM workflow of the RL stage (its answer prompt, ``top_m``, ``show_raw``, retriever).
        tasks: LoCoMo tasks (``load_locomo``) of the training conversations.
        seed: seeds the displayed order of each question's memories.

    Returns:
        The examples and counts: ``answer`` (examples), ``citations`` (cited numbers in all targets),
        ``answers_without_evidence_memory`` (targets citing nothing), ``conversations_without_facts``.
    """
    generator = torch.Generator().manual_seed(seed)
    banks: dict[str, MemoryBank] = {}
    examples: list[SFTExample] = []
    counts: Counter[str] = Counter()
    for task in tasks:
        conversation: Conversation = task.meta["conversation"]
        if conversation.id not in banks:
            banks[conversation.id] = observation_bank(workflow, conversation)
            counts["conversations_without_facts"] += not len(banks[conversation.id])
        shown = [e for e, _ in banks[conversation.id].retrieve(task.question, workflow.top_m, None)]
        order = shown_order(len(shown), True, generator)  # entry j: the memory displayed as [j + 1]
        evidence = set(task.meta.get("evidence") or [])
        cited = [j + 1 for j, i in enumerate(order) if evidence & set(shown[i].source_ids)]
        memories = "\n".join(workflow.render_memory(j + 1, shown[i], conversation) for j, i in enumerate(order))
        prompt = workflow.answer_prompt(task.question, conversation, memories or "(no memories)")
        target = cited_answer_target(task.answers[0], cited)
        meta = {"shown_ids": [shown[i].id for i in order], "cited": cited}  # in displayed order
        examples.append(SFTExample("answer", prompt, target, workflow.system_prompt, task.id, meta))
        counts["citations"] += len(cited)
        counts["answers_without_evidence_memory"] += not cited
    counts["answer"] = len(examples)
    log.info("RMM generator SFT targets from %d conversations: %s", len(banks), dict(counts))
    return examples, counts
