"""BLEU-1, evidence recall, the LLM judge hook (fake transport) and the per-category report."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memrl.errors import ConfigError
from lightning_memrl.evaluation.judge import LLMJudge
from lightning_memrl.evaluation.metrics import bleu1, evidence_recall
from lightning_memrl.evaluation.report import evaluation_report, format_report


def test_bleu1_by_hand():
    """LoCoMo's B1: lower-cased nltk tokens (punctuation and articles are tokens), clipped precision x brevity."""
    assert bleu1("Lisbon", ["Lisbon"]) == 1.0
    # he / moved / to / lisbon / , / portugal (6 tokens, 1 match) vs "lisbon": P = 1/6, BP = 1
    assert bleu1("He moved to Lisbon, Portugal", ["Lisbon"]) == pytest.approx(1 / 6)
    # prediction "may" (1 token) vs "7 may 2023" (3 tokens): P = 1, BP = exp(1 - 3/1)
    assert bleu1("May", ["7 May 2023"]) == pytest.approx(math.exp(-2))
    assert bleu1("the cat cat", ["cat"]) == pytest.approx(1 / 3)  # "the" counts; "cat" clipped to one match
    assert bleu1("7 May, 2023", ["7 May 2023"]) == pytest.approx(3 / 4)  # the comma is a token: 3 of 4, BP = 1
    # two sentences: she / moved / to / lisbon / . / she / loves / it / . -> 1 match of 9
    assert bleu1("She moved to Lisbon. She loves it.", ["Lisbon"]) == pytest.approx(1 / 9)
    assert bleu1("", ["x"]) == 0.0
    assert bleu1("x", ["", "  "]) == 0.0  # no gold answer has a token
    assert bleu1("Rosa", ["Maria", "Rosa"]) == 1.0  # best gold answer


@pytest.mark.parametrize(
    ("prediction", "answer"),
    [
        ("He moved to Lisbon, Portugal", "Lisbon"),
        ("on 7 May 2023", "7 May 2023"),
        ("Caroline's mom can't come", "Caroline's mother"),
        ("the week before 9 June 2023", "The week before 9 June 2023"),
        ("pottery, painting and camping", "Pottery, camping, painting, swimming"),
        ('"Nothing is impossible" (a book)', "'Nothing is Impossible'"),
    ],
)
def test_bleu1_equals_nltk_sentence_bleu_as_locomo_papers_call_it(prediction, answer):
    """The scorer of A-Mem/Mem0 (LoCoMo's B1): word_tokenize(lower) and sentence_bleu(weights (1,0,0,0), method1)."""
    from nltk import word_tokenize
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    def tokens(text):  # one sentence each: nltk's sentence splitter (a separate data download) is not needed
        return word_tokenize(text.lower(), preserve_line=True)

    expected = sentence_bleu(
        [tokens(answer)], tokens(prediction), weights=(1, 0, 0, 0), smoothing_function=SmoothingFunction().method1
    )
    assert bleu1(prediction, [answer]) == pytest.approx(expected, abs=1e-12)
    assert 0.0 < expected <= 1.0


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


@pytest.mark.parametrize(
    ("base_url", "found"),
    [
        ("http://user:sk-SECRET@judge.local:8000/v1", "a user name or password before '@'"),
        ("https://sk-SECRET@judge.local/v1", "a user name or password before '@'"),
        ("https://judge.local:8000/v1?api_key=sk-SECRET", "the query parameter 'api_key'"),
        ("https://judge.local:8000/v1?api-version=2024&access_token=sk-SECRET", "the query parameter 'access_token'"),
        ("https://judge.local:8000/v1?key=sk-SECRET", "the query parameter 'key'"),
    ],
)
def test_llm_judge_refuses_a_credential_in_base_url(base_url, found):
    with pytest.raises(ConfigError) as info:
        LLMJudge(base_url, "judge-model", api_key_env="JUDGE_KEY")
    message = str(info.value)
    assert f"LLMJudge base_url carries a credential ({found})" in message
    assert "environment variable JUDGE_KEY" in message
    assert "SECRET" not in message  # the message never repeats the key
    assert "https://judge.local" in message or "http://judge.local:8000/v1" in message


def test_llm_judge_url_keeps_a_query_that_is_not_a_credential():
    judge = LLMJudge("https://judge.local:8000/v1/?api-version=2024", "m")
    assert judge.url == "https://judge.local:8000/v1/chat/completions?api-version=2024"


def test_cli_refuses_a_judge_url_with_a_key_in_one_message(tmp_path):
    """The judge is built inside the workflow inside the model: the error still reaches the user alone."""
    exe = Path(sys.executable).with_name("lightning-memrl")
    judge = "{class_path: lightning_memrl.evaluation.judge.LLMJudge, init_args: {base_url: 'http://u:sk-SECRET@h/v1', "
    judge += "model: m}}"
    config = Path(__file__).resolve().parents[1] / "configs" / "memory_r1" / "locomo.yaml"
    args = [str(exe), "fit", "--config", str(config), "--model.init_args.workflow.init_args.judge", judge]
    proc = subprocess.run(args, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "error: LLMJudge base_url carries a credential (a user name or password before '@')" in proc.stderr
    assert "Traceback" not in proc.stderr and "SECRET" not in proc.stderr
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "SECRET" in p.read_text(errors="ignore")]


def test_evaluation_log_records_chunks_scores_and_extras_per_task():
    import torch

    from lightning_memrl.evaluation.report import EvaluationLog
    from lightning_memrl.types import ANSWER_TURN, Generation, Task, Trajectory, Turn
    from lightning_memrl.workflows.memagent import MemAgentWorkflow

    task = Task(question="Who?", context=["a", "b"], answers=["Rosa Diaz"], id="t1", meta={"category": 2})
    turn = Turn(ANSWER_TURN, [1], Generation([2], torch.zeros(1), False), text="\\boxed{Rosa}")
    trajectory = Trajectory(task=task, turns=[turn], chunks=["a", "b"])
    log = EvaluationLog()
    em, f1 = log.add(trajectory, None, MemAgentWorkflow())
    # "rosa" vs "rosa diaz": precision 1, recall 1/2 -> F1 2/3; unigram BLEU-1 with brevity penalty exp(1 - 2/1)
    assert (em, f1) == (0.0, pytest.approx(2 / 3))
    ((chunks, em_, f1_, extras),) = log.records
    assert (chunks, em_, f1_) == (2, 0.0, pytest.approx(2 / 3))
    assert extras["category"] == 2 and extras["bleu1"] == pytest.approx(math.exp(-1.0))
    assert log.predictions[0]["answer"] == "Rosa" and log.predictions[0]["exact_match"] == 0.0
