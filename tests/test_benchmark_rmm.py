"""benchmarks/rmm.py end to end with the tiny model: plain retrieval, identity and trained rerankers, resumable."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch
from locomo_fixture import write_two_conversations

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def test_every_arm_is_validated_on_the_held_apart_conversation_and_finished_arms_are_skipped(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("rmm")
    data = write_two_conversations(tmp_path / "data")
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [
        "--locomo", str(data), "--train", "conv-a", "--held-apart", "conv-b",
        "--model", "tiny", "--dtype", "float32", "--max_sessions", "1", "--val_questions", "0", "--steps", "1",
        "--questions_per_step", "2", "--recall_k", "2", "--reranker_lr", "0.1",
        "--out", str(out), "--work", str(work), "--in_process", "--top_k", "3", "--source_turn_feature",
        "--bank_cache", str(tmp_path / "banks.json"),
        "--model.init_args.generation.max_new_tokens=8",
        "--model.init_args.workflow.init_args.reflect_max_tokens=24",
        "--model.init_args.workflow.init_args.merge_max_tokens=12",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    results = bench.main(argv)
    assert list(results) == list(bench.ARMS)
    for arm, result in results.items():
        assert json.loads((out / arm / "result.json").read_text()) == result
        assert result["overall"]["tasks"] == 2 and result["held_apart"] == "conv-b"
        assert 0.0 <= result["overall"]["evidence_recall"] <= 1.0
        assert "conv-b" in result["eval_command"] and "top_m 2" in result["eval_command"]
        assert len((out / arm / "predictions.jsonl").read_text().splitlines()) == 2
    assert "retriever bm25 --model.init_args.workflow.init_args.top_k 2" in results["bm25"]["eval_command"]
    assert "retriever dense --model.init_args.workflow.init_args.top_k 2" in results["dense"]["eval_command"]
    assert results["identity"]["fit"] is None and "--ckpt_path" not in results["identity"]["eval_command"]
    assert "top_k 3" in results["identity"]["eval_command"]  # the rerankers' K
    assert all("bank_cache banks.json" in r["eval_command"] for r in results.values())  # cwd: tmp_path
    stored = json.loads((tmp_path / "banks.json").read_text())["banks"].values()
    # one bank per (conversation, first stage): merges retrieve with it, so the dense arm's banks are its own
    assert sorted((e["conversation"], e["recipe"]["options"]["retriever"]) for e in stored) == [
        ("conv-a", "bm25"),
        ("conv-b", "bm25"),
        ("conv-b", "dense"),
    ]
    for arm, reward in (("reranker_citation", "citation"), ("reranker_evidence", "evidence")):
        fit = results[arm]["fit"]
        assert f"reranker_reward {reward}" in fit["command"] and "train_generator false" in fit["command"]
        assert "source_turn_feature true" in fit["command"] and "top_k 3" in fit["command"]
        assert fit["steps"] == 1 and fit["fit_wall_s"] > 0 and "--ckpt_path" in results[arm]["eval_command"]
        assert all(isinstance(fit[f"mean train/{name}"], float) for name in bench.FIT_METRICS)
    # the validated checkpoint holds the trained reranker (the tiny model writes no topics, so it has not moved:
    # tests/test_rmm_signal.py checks that the evidence reward moves it)
    state = torch.load(work / "reranker_evidence" / "fit" / "checkpoints" / "last.ckpt", weights_only=False)
    assert "workflow_modules.reranker.query_adapter.weight" in state["state_dict"]
    calls = []
    monkeypatch.setattr(bench, "run_cli", lambda *a: calls.append(a))
    assert bench.main(argv) == results and calls == []  # finished arms are skipped
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == set(results) and summary["caps"]["steps"] == 1


def test_a_warm_started_generator_answers_while_the_base_reflects(tmp_path, monkeypatch, tiny_tokenizer):
    from lightning_memrl.adapters import LoraSettings
    from lightning_memrl.models import load_policy

    adapter = tmp_path / "adapter"
    policy = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=16, lora_alpha=32, init_lora_weights=False))
    policy.save_pretrained(adapter)  # B != 0: another generator than the base
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("rmm")
    data = write_two_conversations(tmp_path / "data")
    argv = [
        "--locomo", str(data), "--train", "conv-a", "--held-apart", "conv-b", "--arms", "identity",
        "--model", "tiny", "--dtype", "float32", "--max_sessions", "1", "--val_questions", "0",
        "--recall_k", "2", "--top_k", "3", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
        "--in_process", "--bank_cache", str(tmp_path / "banks.json"), "--generator_adapter", str(adapter),
        "--model.init_args.generation.max_new_tokens=8",
        "--model.init_args.workflow.init_args.reflect_max_tokens=24",
        "--model.init_args.workflow.init_args.merge_max_tokens=12",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    result = bench.main(argv)["identity"]
    assert "adapter_name_or_path adapter" in result["eval_command"]  # relative to the working folder
    assert "reflect_with_base true" in result["eval_command"] and result["caps"]["generator_adapter"]
    (stored,) = json.loads((tmp_path / "banks.json").read_text())["banks"].values()
    model = stored["recipe"]["model"]
    assert "adapter" not in model and "disabled" in model["description"]  # built by the base, not the generator
    for line in (tmp_path / "out" / "identity" / "predictions.jsonl").read_text().splitlines():
        row = json.loads(line)  # the raw answer with its citations, what was shown and what it cited
        assert isinstance(row["response"], str) and {"shown_ids", "cited"} <= set(row)
    assert result["answer_stats"]["answers"] == 2 and 0.0 <= result["answer_stats"]["in_format"] <= 1.0


def test_answer_stats_count_the_format_and_the_citations(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("rmm")
    rows = [
        {"response": "Answer: \\boxed{Rosa}\nCitations: [2]", "shown_ids": ["m1", "m4"], "cited": [1]},
        {"response": "Tim: hello", "shown_ids": ["m0", "m2"], "cited": [], "evidence_rewards": [1.0, -1.0]},
        {"response": "answer: Lisbon. citations: 1, 2", "shown_ids": ["m3", "m5"], "cited": [0, 1]},
        {"completion": "a row of another workflow"},
    ]
    rows[0]["evidence_rewards"], rows[2]["evidence_rewards"] = [-1.0, 1.0], [-1.0, -1.0]
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.answer_stats(path) == {
        "answers": 3,
        "in_format": 2 / 3,
        "citing": 2 / 3,
        "cited_per_shown": 0.5,
        "cited_holding_evidence": 1 / 3,  # m4 of the three cited memories
        "shown_holding_evidence": 2 / 6,  # m4 and m0
    }
