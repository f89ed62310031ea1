"""BLEU-1, evidence recall, the LLM judge hook (fake transport) and the per-category report."""

from __future__ import annotations

import math

import pytest

from lightning_memrl.evaluation import LLMJudge, bleu1, evidence_recall
from lightning_memrl.module import evaluation_report, format_report


def test_bleu1_by_hand():
    assert bleu1("Lisbon", ["Lisbon"]) == 1.0
    # "he moved to lisbon portugal" (5 words, 1 match) vs reference "lisbon" (1 word): P = 1/5, BP = 1
    assert bleu1("He moved to Lisbon, Portugal", ["Lisbon"]) == pytest.approx(1 / 5)
    # prediction "may" (1 word) vs "7 may 2023" (3 words): P = 1, BP = exp(1 - 3/1)
    assert bleu1("May", ["7 May 2023"]) == pytest.approx(math.exp(-2))
    assert bleu1("the cat cat", ["cat"]) == pytest.approx(1 / 2)  # "the" dropped; "cat" clipped to one match
    assert bleu1("", ["x"]) == 0.0
    assert bleu1("Rosa", ["Maria", "Rosa"]) == 1.0  # best gold answer


def test_evidence_recall():
    assert evidence_recall(["D1:1", "D2:2"], ["D1:1", "D3:1"]) == 0.5
    assert evidence_recall(set(), ["D1:1"]) == 0.0
    assert evidence_recall(["D1:1"], []) is None


def test_llm_judge_with_a_fake_transport(monkeypatch):
    seen = []

    def transport(url, headers, payload):
        seen.append((url, headers, payload))
        return {"choices": [{"message": {"content": '{"label": "CORRECT"}' if len(seen) == 1 else "WRONG"}}]}

    monkeypatch.setenv("JUDGE_KEY", "secret")
    judge = LLMJudge("http://judge.local/v1/", "judge-model", api_key_env="JUDGE_KEY", transport=transport)
    assert judge("Where did Ben move?", ["Lisbon"], "to Lisbon") == 1.0
    assert judge("Where did Ben move?", ["Lisbon"], "Paris") == 0.0
    url, headers, payload = seen[0]
    assert url == "http://judge.local/v1/chat/completions"
    assert headers["Authorization"] == "Bearer secret" and payload["model"] == "judge-model"
    assert "Gold answer: Lisbon" in payload["messages"][0]["content"]
    assert "Generated answer: to Lisbon" in payload["messages"][0]["content"]


def test_llm_judge_failures_are_counted_not_raised():
    def broken(url, headers, payload):
        raise ConnectionError("refused")

    judge = LLMJudge("http://x/v1", "m", transport=broken)
    assert judge("q", ["a"], "b") is None
    mumble = LLMJudge("http://x/v1", "m", transport=lambda *_: {"choices": [{"message": {"content": "maybe"}}]})
    assert mumble("q", ["a"], "b") is None
    assert (judge.failures, mumble.failures) == (1, 1)
    with pytest.raises(ValueError, match="placeholders"):
        LLMJudge("http://x/v1", "m", prompt="no fields")


def test_report_by_category_with_extra_metrics():
    records = [
        (2, 1.0, 1.0, {"category": 4, "bleu1": 1.0, "evidence_recall": 1.0}),
        (2, 0.0, 0.5, {"category": 4, "bleu1": 0.25, "evidence_recall": None}),  # None: not measured
        (3, 0.0, 0.0, {"category": 1, "bleu1": 0.0, "evidence_recall": 0.5}),
    ]
    report = evaluation_report(records, step=7, model="m")
    assert report["overall"] == {
        "tasks": 3,
        "exact_match": pytest.approx(1 / 3),
        "f1": pytest.approx(0.5),
        "bleu1": pytest.approx(1.25 / 3),
        "evidence_recall": pytest.approx(0.75),
    }
    assert report["by_category"]["4"]["evidence_recall"] == 1.0 and report["by_category"]["4"]["tasks"] == 2
    assert report["by_category"]["1"]["f1"] == 0.0
    assert set(report["by_num_chunks"]) == {"2", "3"}
    text = format_report(report)
    assert "category" in text and "evidence_recall" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("4 "))
    assert row.split() == ["4", "2", "50.0%", "75.0%", "62.5%", "100.0%"]


def test_report_without_extras_keeps_its_shape():
    report = evaluation_report([(1, 1.0, 1.0), (2, 0.0, 0.0)])
    assert "by_category" not in report and set(report["overall"]) == {"tasks", "exact_match", "f1"}
    assert format_report(report).splitlines()[1].split() == ["chunks", "tasks", "exact_match", "f1"]
