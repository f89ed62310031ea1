"""Memory-R1's supervised targets, built from the LoCoMo fixture's annotated facts."""

from __future__ import annotations

import json

import pytest
from locomo_fixture import locomo_conversation, write_locomo

from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.errors import DataError
from lightning_memrl.sft.targets import build_sft_examples
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow


def test_targets_are_the_hand_written_ones(tmp_path):
    workflow = MemoryR1Workflow()
    examples, counts = build_sft_examples(workflow, load_locomo(write_locomo(tmp_path)))
    got = [(e.part, e.source, e.target) for e in examples]
    assert got == [
        (
            "extract",
            "conv-test D1:1-D1:2",
            "[D1:1] Ana adopted a cat named Miso.\n[D1:2] Ben started learning the violin.",
        ),
        (
            "extract",
            "conv-test D2:1-D2:2",
            "[D2:1] Ana's cat Miso broke a vase.\n[D2:2] Ben moved to Lisbon.\n[D2:2] Ben started learning the Violin.",
        ),
        ("extract", "conv-test D3:1-D3:1", "[D3:1] Ben's violin teacher is Rosa."),
        ("manage", "conv-test D1:1", '{"op": "ADD", "text": "Ana adopted a cat named Miso."}'),
        ("manage", "conv-test D1:2", '{"op": "ADD", "text": "Ben started learning the violin."}'),
        ("manage", "conv-test D2:1", '{"op": "ADD", "text": "Ana\'s cat Miso broke a vase."}'),
        ("manage", "conv-test D2:2", '{"op": "ADD", "text": "Ben moved to Lisbon."}'),
        ("manage", "conv-test D2:2", '{"op": "NOOP"}'),  # m1 already says it (case and spacing aside)
        ("manage", "conv-test D3:1", '{"op": "ADD", "text": "Ben\'s violin teacher is Rosa."}'),
        ("answer", "conv-test:qa0", "Memories: m0\nAnswer: \\boxed{Miso}"),
        ("answer", "conv-test:qa1", "Memories: m3\nAnswer: \\boxed{Lisbon}"),
        ("answer", "conv-test:qa2", "Memories: m0\nAnswer: \\boxed{2023}"),
        ("answer", "conv-test:qa3", "Memories: m4, m1\nAnswer: \\boxed{Rosa}"),  # evidence D3:1 and D1:2
    ]
    assert counts["facts_without_turn"] == 1  # "Ana likes green tea." cites D9:9, no turn of session 3
    assert (counts["ADD"], counts["NOOP"]) == (5, 1)
    # the prompts are the RL stage's own: the manager of the NOOP fact is shown m1 with the same words
    noop = examples[7]
    assert "[m1] (1:00 pm on 3 May, 2023) Ben started learning the violin." in noop.prompt
    assert noop.prompt.startswith("You manage a memory bank.")
    assert "New fact (2:00 pm on 9 May, 2023): Ben started learning the Violin." in noop.prompt
    conv = load_locomo(write_locomo(tmp_path))[0].meta["conversation"]
    assert examples[0].prompt == workflow.extract_prompt(workflow.segments(conv)[0])
    assert "Question: Who teaches Ben?" in examples[-1].prompt and "[m4]" in examples[-1].prompt


def test_max_facts_and_parts(tmp_path):
    workflow = MemoryR1Workflow(max_facts=2)
    examples, counts = build_sft_examples(workflow, load_locomo(write_locomo(tmp_path)), parts=["manage"])
    assert {e.part for e in examples} == {"manage"}
    assert len(examples) == 5 and counts["facts_over_max_facts"] == 1  # segment 2 had three facts
    assert all(json.loads(e.target)["op"] == "ADD" for e in examples)
    with pytest.raises(ValueError, match="sft parts must be among"):
        build_sft_examples(workflow, load_locomo(write_locomo(tmp_path)), parts=["summary"])


def test_bad_observation_row_names_the_field(tmp_path):
    data = locomo_conversation()
    data["session_2_observation"]["Ben"][0] = ["a fact without its turn"]
    with pytest.raises(DataError, match=r"session_2_observation\['Ben'\]\[0\]: expected \[fact, dia_id"):
        load_locomo(write_locomo(tmp_path, conversation=data))


def test_valid_operation_rate_counts_parseable_applicable_operations(tmp_path):
    from scripted_engine import ScriptedEngine

    from lightning_memrl.models import build_tiny_tokenizer
    from lightning_memrl.sft.evaluate import valid_operation_rate

    def reply(prompt: str) -> str:
        if "New fact (2:00 pm on 9 May, 2023): Ben moved to Lisbon." in prompt:
            return '{"op": "ADD", "text": "Ben lives in Lisbon."}'  # valid, the target's operation
        if "Ben started learning the Violin." in prompt:
            return "UPDATE m1: Ben plays the violin."  # valid (m1 is shown), not the target's NOOP
        if "Miso broke a vase" in prompt:
            return '{"op": "DELETE", "id": "m7"}'  # m7 was not shown: not applicable
        return "I think this is a nice fact."  # no operation

    workflow = MemoryR1Workflow()
    examples, _ = build_sft_examples(workflow, load_locomo(write_locomo(tmp_path)))
    engine = ScriptedEngine(build_tiny_tokenizer(), reply)
    result = valid_operation_rate(workflow, engine, examples)
    assert (result["facts"], result["valid"], result["agree"]) == (6, 2, 1)
    assert result["rate"] == 2 / 6
    assert result["ops"] == {"ADD": 1, "UPDATE": 1}
    assert result["problems"] == {"no operation found": 3, "unknown memory id": 1}
    assert all(t == 0 for _, t in engine.calls)  # greedy
