"""benchmarks/retrieval.py: Recall@k of evidence turns, hand-computed on a three-question conversation."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from tests.locomo_fixture import locomo_conversation, write_locomo

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# Units are the fixture's five turns, "speaker: text" (D2:1 with its photo caption). BM25 (stop words out):
#   Q1 "Which vase broke?"           -> only D2:1 matches                      evidence D2:1
#   Q2 "Who teaches Ben the violin?" -> D3:1 = D1:2 (ben, violin; newer first), evidence D3:1 D1:2 D2:2
#                                       then D2:2 (ben)
#   Q3 "When did Ana go to Lisbon?"  -> D2:2 (lisbon, the rarer word), then D1:1 (ana; shorter than D2:1),
#                                       evidence D1:1
QUESTIONS = [
    {"question": "Which vase broke?", "answer": "blue", "evidence": ["D2:1"], "category": 4},
    {"question": "Who teaches Ben the violin?", "answer": "Rosa", "evidence": ["D3:1", "D1:2", "D2:2"], "category": 1},
    {"question": "When did Ana go to Lisbon?", "answer": "never", "evidence": ["D1:1"], "category": 2},
    {"question": "What did Ben's cat break?", "evidence": ["D2:1"], "category": 5},  # category 5: left out
]


@pytest.fixture
def retrieval(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other as top-level modules
    return importlib.import_module("retrieval")


@pytest.fixture
def locomo(tmp_path: Path) -> Path:
    other = locomo_conversation()
    write_locomo(tmp_path / "locomo", "conv-a", other)  # trains in the config's split
    return write_locomo(tmp_path / "locomo", "conv-b", {**locomo_conversation(), "qa": QUESTIONS}).parent


def reversing_checkpoint(path: Path, dim: int = 256) -> Path:
    """A checkpoint whose reranker scores -(m . q): the identity reranker's order reversed."""
    weights = {
        "query_adapter.weight": torch.zeros(dim, dim),
        "query_adapter.bias": torch.zeros(dim),
        "memory_adapter.weight": -2 * torch.eye(dim),
        "memory_adapter.bias": torch.zeros(dim),
    }
    torch.save({"state_dict": {f"workflow_modules.reranker.{k}": v for k, v in weights.items()}}, path)
    return path


def test_recall_at_k_of_bm25_and_the_rerankers_over_bm25_top_2(retrieval, locomo, tmp_path, capsys):
    out = tmp_path / "result.json"
    ckpt = reversing_checkpoint(tmp_path / "rmm.ckpt")
    argv = ["--locomo", str(locomo), "--retrievers", "bm25", "rerank-identity", "rerank-trained", "--ckpt", str(ckpt)]
    result = retrieval.main([*argv, "--first-stage", "bm25", "--top-k", "2", "--k", "1", "2", "--out", str(out)])
    assert result["conversations"] == ["conv-b"]  # the config's split holds the last conversation apart
    assert result["questions"] == 3 and result["units"]["turns"]["units"] == 5
    got = result["results"]["turns"]
    bm25 = got["bm25"]["all"]
    # R@1: Q1 1, Q2 1/3 (D3:1), Q3 0 (D2:2); R@2: Q1 1 (one match), Q2 2/3, Q3 1
    assert bm25["recall@1"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert bm25["recall@2"] == pytest.approx((1 + 2 / 3 + 1) / 3)
    assert bm25["turns@2"] == pytest.approx((1 + 2 + 2) / 3)
    category_2 = {"questions": 1, "recall@1": 0.0, "recall@2": 1.0, "turns@1": 1.0, "turns@2": 2.0}
    assert got["bm25"]["by_category"]["2"] == category_2  # Q3 alone
    # the identity reranker orders BM25's top 2 by hashed word overlap: Q3's D2:2 shares "to", "lisbon",
    # "to lisbon" with the question and D1:1 only "ana", so R@1 stays 0; Q2's top 2 are both evidence
    identity = got["rerank-identity"]["all"]
    assert identity["recall@1"] == pytest.approx((1 + 1 / 3 + 0) / 3)
    assert identity["recall@2"] == pytest.approx((1 + 2 / 3 + 1) / 3)  # same top 2, reordered
    # the checkpoint's reranker reverses that order: Q3 now finds D1:1 first
    assert got["rerank-trained"]["all"]["recall@1"] == pytest.approx((1 + 1 / 3 + 1) / 3)
    saved = json.loads(out.read_text())
    assert saved["results"]["turns"] == json.loads(json.dumps(got)) and saved["machine"]["threads"] == 1
    printed = capsys.readouterr().out
    assert "| turns | bm25 | 3 | 0.4444 | 0.8889 |" in printed and f"wrote {out}" in printed


def test_options_that_cannot_work_stop_with_one_message(retrieval, locomo, tmp_path):
    with pytest.raises(SystemExit):
        retrieval.parse_args(["--locomo", str(locomo), "--retrievers", "rerank-trained"])  # needs --ckpt
    with pytest.raises(SystemExit):
        retrieval.parse_args(["--locomo", str(locomo), "--top-k", "5", "--k", "10"])  # rerankers only order K
    bad = reversing_checkpoint(tmp_path / "wide.ckpt", dim=8)
    argv = ["--locomo", str(locomo), "--retrievers", "rerank-trained", "--first-stage", "bm25", "--ckpt", str(bad)]
    with pytest.raises(SystemExit, match="the reranker is 8 wide but --rerank-embedding gives 256-dim vectors"):
        retrieval.main([*argv, "--k", "1", "--top-k", "2", "--out", str(tmp_path / "r.json")])
