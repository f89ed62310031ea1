"""The multi-chunk setting: distractors spread over the other chunks, 2-hop facts in distinct chunks,
mixed hops, and the evaluation report by the position of the chunk that held the answer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import DataError
from lightning_memrl.evaluation.report import evaluation_report, format_report

CODE_FACT = re.compile(r"The secret code of (\w+) is (\d{4})\.")
ROOT = Path(__file__).resolve().parent.parent


def _code_facts_per_chunk(task) -> list[int]:
    return [len(CODE_FACT.findall(chunk)) for chunk in task.context]


def test_spread_puts_one_same_pattern_distractor_in_every_other_chunk():
    config = SyntheticTaskSettings(
        num_tasks=50, min_chunks=4, max_chunks=6, distractor_facts=5, distractor_placement="spread", seed=3
    )
    positions = set()
    for task in generate_synthetic_tasks(config):
        (answer,) = task.meta["evidence_chunks"]
        assert task.meta["answer_chunk"] == answer and task.meta["hops"] == 1
        counts = _code_facts_per_chunk(task)
        assert counts[answer] == 1  # the answer's chunk gets no distractor: the others take them in turn
        others = [c for i, c in enumerate(counts) if i != answer]
        assert min(others) >= 1 and max(others) - min(others) <= 1  # every other chunk states a code
        (code,) = task.answers
        assert f"is {code}." in task.context[answer]
        positions.add(answer)
    assert positions == set(range(6))  # the answer's chunk is drawn at random, first to last


def test_distinct_hop_chunks_put_the_two_facts_in_different_chunks():
    config = SyntheticTaskSettings(
        num_tasks=60, min_chunks=2, max_chunks=5, hops=2, hop_chunks="distinct", distractor_facts=3, seed=4
    )
    for task in generate_synthetic_tasks(config):
        bridge, code_chunk = (
            next(i for i, c in enumerate(task.context) if "uses the same secret code as" in c),
            task.meta["answer_chunk"],
        )
        assert bridge != code_chunk and sorted([bridge, code_chunk]) == task.meta["evidence_chunks"]
        assert f"is {task.answers[0]}." in task.context[code_chunk]
    # the default (random) lets both facts share a chunk in some tasks
    same = [
        t
        for t in generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=60, hops=2, seed=4))
        if len(set(t.meta["evidence_chunks"])) == 1
    ]
    assert same


def test_two_hop_share_mixes_one_and_two_hop_tasks():
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=200, two_hop_share=0.25, max_chunks=4, seed=9))
    two_hop = [t for t in tasks if t.meta["hops"] == 2]
    assert 30 <= len(two_hop) <= 70  # ~50 of 200
    assert all("uses the same secret code as" in " ".join(t.context) for t in two_hop)
    assert all(t.meta["hops"] == 1 and len(t.meta["evidence_chunks"]) == 1 for t in tasks if t not in two_hop)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"distractor_placement": "even"}, "distractor_placement must be random or spread"),
        ({"hop_chunks": "apart"}, "hop_chunks must be random or distinct"),
        ({"two_hop_share": 1.5}, "two_hop_share must be null or in [0, 1]"),
        ({"hops": 2, "hop_chunks": "distinct", "min_chunks": 1}, "hop_chunks: distinct needs min_chunks >= 2"),
    ],
)
def test_bad_placement_options_name_the_option(knobs, message):
    with pytest.raises(DataError, match=re.escape(message)):
        generate_synthetic_tasks(SyntheticTaskSettings(**knobs))


def test_report_by_answer_position_and_hops_from_hand_built_records():
    records = [
        (4, 1.0, 1.0, {"answer_position": 1, "hops": 1, "bleu1": 1.0}),
        (4, 0.0, 0.0, {"answer_position": 1, "hops": 2, "bleu1": 0.0}),
        (5, 1.0, 1.0, {"answer_position": 4, "hops": 1, "bleu1": 1.0}),
        (6, 1.0, 1.0, {"answer_position": 10, "hops": 1, "bleu1": 1.0}),
    ]
    report = evaluation_report(records, step=3, model="m")
    assert list(report["by_answer_position"]) == ["1", "4", "10"]  # numeric order: the retention curve
    assert report["by_answer_position"]["1"] == {"tasks": 2, "exact_match": 0.5, "f1": 0.5, "bleu1": 0.5}
    assert report["by_hops"]["2"]["exact_match"] == 0.0 and report["by_hops"]["1"]["tasks"] == 3
    assert set(report["overall"]) == {"tasks", "exact_match", "f1", "bleu1"}  # groupings are not averaged
    text = format_report(report)
    row = next(line for line in text.splitlines() if line.split()[:2] == ["10", "1"])
    assert row.split() == ["10", "1", "100.0%", "100.0%", "100.0%"]
    assert "position" in text and "hops" in text


def test_multichunk_config_documents_every_key_and_keeps_a_held_out_seed():
    path = ROOT / "configs" / "memagent" / "multichunk.yaml"
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#") and not line.lstrip().startswith("- "):
            assert "#" in line, f"{path.name}:{number} has no comment: {line!r}"
    config = yaml.safe_load(path.read_text())
    data = config["data"]["init_args"]
    train, val = data["synthetic"], data["synthetic_val"]
    assert 4 <= train["min_chunks"] <= train["max_chunks"] <= 6 and train["distractor_placement"] == "spread"
    assert val["seed"] != train["seed"] and val["two_hop_share"] > 0 and val["hop_chunks"] == "distinct"
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(**{**val, "num_tasks": 8}))
    workflow = config["model"]["init_args"]["workflow"]["init_args"]
    assert workflow["max_chunks"] >= val["max_chunks"]  # no chunk holding the answer is dropped
    words = sum(len(" ".join(t.context).split()) for t in tasks) / len(tasks)
    assert workflow["max_memory_tokens"] * 3 < words  # the notes budget is far below the context
