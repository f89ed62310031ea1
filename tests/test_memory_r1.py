"""Memory-R1 workflow with a scripted engine: extraction, manager operations, bad output, stages."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine

from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, RolloutBatch
from lightning_memrl.workflows.bank import BankWorkflow, parse_items, record_shown, split_segments
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=16)
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=16)


def reply(prompt: str) -> str:
    if "List at most" in prompt:  # the extractor
        if "session_1 (" in prompt:
            return "Facts:\n1. [D1:1] Ana adopted a cat named Miso.\n- Ben learns the violin."
        if "session_2 (" in prompt:
            return "[D2:2] Ben moved to Lisbon."
        return "none"
    if "You manage a memory bank" in prompt:
        fact = prompt.split("New fact", 1)[1]
        if "Miso" in fact:
            return '{"op": "ADD", "text": "Ana has a cat named Miso"}'
        if "violin" in fact:
            return "I am not sure what to do here."  # no operation: NOOP + penalty
        return "ADD"
    return "Memories: m0, m9\nAnswer: \\boxed{Miso}"  # m9 was never shown: not a selection


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path))


def test_manager_stage_trains_manager_turns_against_a_frozen_answerer(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0, format_penalty=0.1)
    workflow.frozen_engine = engine  # one scripted engine records every call (tests/test_frozen_agents.py splits them)
    trajectories = workflow.rollout(engine, [tasks[0], tasks[0]], SAMPLED)  # a group of two
    first = trajectories[0]
    assert [(t.kind, t.trainable) for t in first.turns] == [(MEMORY_TURN, True)] * 3 + [(ANSWER_TURN, False)]
    assert [t.reward for t in first.turns[:3]] == [0.0, -0.1, 0.0]
    assert first.final_text == "\\boxed{Miso}"  # the memory list is not part of the scored answer
    assert first.info["selected_ids"] == ["m0"] and first.info["bank_size"] == 2
    assert "D1:1" in first.info["shown_source_ids"]
    assert workflow.evaluation_metrics(first)["evidence_recall"] == 1.0
    temps = {
        kind: {t for p, t in engine.calls if key in p}
        for kind, key in (("extract", "List at most"), ("manage", "You manage"), ("answer", "Memories: m1, m2"))
    }
    assert temps == {"extract": {0.0}, "manage": {1.0}, "answer": {0.0}}  # frozen parts run greedily
    assert sum("List at most" in p for p, _ in engine.calls) == 3  # facts extracted once for the group
    assert workflow.counters["invalid"] == 2 and workflow.counters["ADD"] == 4  # two members x 3 facts
    batch = RolloutBatch.from_trajectories(trajectories, group_size=2, pad_id=engine.pad_id)
    assert batch.response_ids.shape[0] == 6  # manager turns only: the frozen answer carries no loss
    torch.testing.assert_close(batch.turn_rewards, torch.tensor([0.0, -0.1, 0.0] * 2))
    assert batch.memory_turns.all()
    assert workflow.module_loss(batch) is None  # the manager is the policy: no loss of its own
    metrics = workflow.step_metrics(batch)
    assert metrics["manager/invalid_frac"] == pytest.approx(1 / 3)
    assert metrics["manager/add_frac"] == pytest.approx(2 / 3)


def test_bank_contents_and_sources(tasks, tiny_tokenizer):
    workflow = MemoryR1Workflow(turns_per_segment=0)
    conversation = tasks[0].meta["conversation"]
    workflow.frozen_engine = engine = ScriptedEngine(tiny_tokenizer, reply)
    ((bank, turns),) = workflow.build_banks(engine, [conversation], GREEDY, False)
    assert [(e.id, e.text, e.source_ids, e.session) for e in bank.entries] == [
        ("m0", "Ana has a cat named Miso", ["D1:1"], "session_1"),
        ("m1", "Ben moved to Lisbon.", ["D2:2"], "session_2"),  # ADD without text stores the fact
    ]
    assert all(not t.trainable for t in turns)


def test_answerer_stage_caches_frozen_banks(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = MemoryR1Workflow(stage="answerer", turns_per_segment=0)
    workflow.frozen_engine = engine
    first = workflow.rollout(engine, tasks[:2], SAMPLED)
    calls = len(engine.calls)
    second = workflow.rollout(engine, tasks[2:], SAMPLED)
    assert len(engine.calls) - calls == 2  # only the two answers: the bank was built once
    for trajectory in first + second:
        assert [(t.kind, t.trainable) for t in trajectory.turns] == [(ANSWER_TURN, True)]
    assert engine.calls[-1][1] == 1.0  # the trained answerer samples
    state = workflow.state_dict()
    restored = MemoryR1Workflow(stage="answerer", turns_per_segment=0)
    restored.frozen_engine = engine
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    restored.rollout(engine, tasks[:1], SAMPLED)
    assert sum("You manage" in p for p, _ in engine.calls[calls + 2 :]) == 0  # restored cache: no rebuild


def test_validation_builds_one_bank_per_conversation(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0)
    workflow.frozen_engine = engine
    workflow.rollout(engine, tasks, GREEDY)
    assert sum("You manage" in p for p, _ in engine.calls) == 3  # 3 facts, once, for 4 questions
    workflow.rollout(engine, tasks, SAMPLED)  # training changes the policy: greedy banks are rebuilt after it
    before = sum("You manage" in p for p, _ in engine.calls)
    workflow.rollout(engine, tasks[:1], GREEDY)
    assert sum("You manage" in p for p, _ in engine.calls) == before + 3


def test_garbage_everywhere_never_crashes(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda p: "}{ ]]" if "You manage" in p else "[D1:1] some fact here")
    workflow = MemoryR1Workflow(turns_per_segment=1, max_facts=2)
    workflow.frozen_engine = engine
    trajectories = workflow.rollout(engine, tasks[:1], SAMPLED)
    assert workflow.counters["invalid"] == workflow.counters["facts"] > 0
    assert trajectories[0].info["bank_size"] == 0 and trajectories[0].info["shown_source_ids"] == []
    assert workflow.evaluation_metrics(trajectories[0])["evidence_recall"] == 0.0


def test_parse_items_and_segments(tasks):
    counts = Counter()
    items = parse_items(
        "Facts:\n1. [D1:2] Ben plays violin\n* Ana [D9:9] likes tea\n\nnone\n- ok", ["D1:1", "D1:2"], 5, counts
    )
    assert counts == {"uncited": 1}
    assert items == [("Ben plays violin", ["D1:2"]), ("Ana likes tea", ["D1:1", "D1:2"])]  # D9:9 is not in the segment
    # a line repeating the prompt's example (small models copy it) is dropped and counted; a short one is kept
    prompt = "List the facts, e.g.\n[D1:3] Caroline went to a support group on 7 May 2023."
    text = "[D1:3] Caroline went to a Support Group on 7 May 2023\n[D1:1] Ana has a cat\n[D1:2] facts"
    assert parse_items(text, ["D1:1", "D1:2"], 5, counts, instructions=prompt) == [
        ("Ana has a cat", ["D1:1"]),
        ("facts", ["D1:2"]),
    ]
    assert counts == {"uncited": 1, "copied": 1}
    segments = split_segments(tasks[0].meta["conversation"], turns_per_segment=1)
    assert [s.source_ids for s in segments] == [["D1:1"], ["D1:2"], ["D2:1"], ["D2:2"], ["D3:1"]]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="stage must be 'manager' or 'answerer'"):
        MemoryR1Workflow(stage="both")
    with pytest.raises(ValueError, match=r"manage_template lacks the placeholders \['\{fact\}'\]"):
        MemoryR1Workflow(manage_template="{memories}")


class _WholeSessions(BankWorkflow):
    """A bank workflow written against the hooks only: one entry per session, every entry shown."""

    def __init__(self) -> None:
        super().__init__("{memories}\nQ: {question} ({speaker_a}, {speaker_b})", turns_per_segment=0)

    def build_banks(self, engine, conversations, settings, trainable):
        banks = []
        for conversation in conversations:
            bank = self.new_bank()
            for segment in self.segments(conversation):
                bank.add(segment.text, segment.session.name, segment.session.date_time, segment.source_ids)
            banks.append((bank, []))
        return banks

    def answer_is_trained(self) -> bool:
        return True

    def show_memories(self, trajectories, banks, training):
        for trajectory, bank in zip(trajectories, banks):
            record_shown(trajectory, bank.entries)
        return [bank.format(bank.entries) for bank in banks]


def test_a_bank_workflow_needs_only_its_banks_and_what_it_shows(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "I think so. Answer: \\boxed{Miso}")
    (trajectory,) = _WholeSessions().rollout(engine, tasks[:1], SAMPLED)
    (turn,) = trajectory.turns
    assert (turn.kind, turn.trainable, turn.text) == (ANSWER_TURN, True, "\\boxed{Miso}")  # after "Answer:"
    assert trajectory.info["answer_raw"] == "I think so. Answer: \\boxed{Miso}"
    assert trajectory.info["shown_ids"] == ["m0", "m1", "m2"]  # one entry per session
    assert trajectory.info["shown_source_ids"] == ["D1:1", "D1:2", "D2:1", "D2:2", "D3:1"]
    prompt, temperature = engine.calls[-1]
    assert "Q: What is the name of Ana's cat? (Ana, Ben)" in prompt and "Rosa" in prompt and temperature == 1.0


def test_evaluation_reports_the_valid_operation_rate_of_each_greedy_bank(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)  # 3 facts; the violin one gets no usable operation
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0)
    workflow.frozen_engine = engine
    greedy = workflow.rollout(engine, tasks[:2], GREEDY)
    assert [workflow.evaluation_metrics(t)["valid_operations"] for t in greedy] == [pytest.approx(2 / 3)] * 2
    workflow._valid_ops.clear()
    workflow.rollout(engine, tasks[:1], SAMPLED)  # a training rollout's sampled banks are not the evaluated ones
    assert workflow.evaluation_metrics(greedy[0])["valid_operations"] is None
    assert workflow.state_dict()["valid_operations"] == {}


@pytest.mark.parametrize("workflow_class", [MemoryR1Workflow, RMMWorkflow], ids=["memory_r1", "rmm"])
def test_dense_retrieval_uses_the_workflows_embedding(workflow_class):
    workflow = workflow_class(retriever="dense", embedding="hashing", embedding_dim=512)
    bank = workflow.new_bank()
    bank.add("Caroline moved to Boston in May", source_ids=["D1:1"])
    bank.add("Melanie paints landscapes", source_ids=["D1:2"])
    assert bank.embedder is workflow.embedder and bank.embedder.dim == 512  # was None: the bank made a 256-dim one
    assert [e.text for e, _ in bank.retrieve("where did Caroline move", 1)] == ["Caroline moved to Boston in May"]
    with pytest.raises(ValueError, match="workflow embedding must be 'hashing' or 'sentence-transformers'"):
        workflow_class(embedding="word2vec")
