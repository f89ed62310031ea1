"""benchmarks/memory_r1.py end to end with the tiny model: every stage a real fit, every arm evaluated, resumable."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from locomo_fixture import write_two_conversations

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
METRICS = ("exact_match", "f1", "bleu1", "evidence_recall", "valid_operations")


def test_pipeline_runs_every_arm_on_the_held_apart_conversation_and_skips_finished_ones(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("memory_r1")
    data = write_two_conversations(tmp_path / "data")
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [
        "--locomo", str(data), "--train", "conv-a", "--held-apart", "conv-b",
        "--model", "tiny", "--dtype", "float32", "--max_sessions", "1",
        "--sft_steps", "1", "--grpo_manager_steps", "1", "--grpo_answerer_steps", "1",
        "--reward", "f1", "--group_size", "3", "--val_questions", "1", "--kl_coef", "0.05",
        "--out", str(out), "--work", str(work), "--in_process",
        "--model.init_args.generation.max_new_tokens=8",
        "--model.init_args.workflow.init_args.extract_max_tokens=24",
        "--model.init_args.workflow.init_args.manage_max_tokens=12",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    results = bench.main(argv)
    assert list(results) == ["base", "sft", "sft+grpo_manager", "sft+grpo_manager+grpo_answerer"]
    for arm, result in results.items():
        saved = json.loads((out / arm / "result.json").read_text())
        assert saved == result and saved["held_apart"] == "conv-b"
        assert saved["overall"]["tasks"] == 1  # --val_questions 1 of conv-b's 2 with evidence in session 1
        assert saved["caps"]["held_apart_questions"] == 1 and saved["caps"]["grpo_reward"] == "f1"
        for row in [saved["overall"], *saved["by_category"].values()]:
            assert all(0.0 <= row[k] <= 1.0 for k in METRICS if k != "valid_operations"), row
            assert row["valid_operations"] is None  # the tiny model's facts decode to nothing: no operation to rate
        assert saved["caps"]["grpo_answerer_steps"] == 1 and saved["caps"]["seed"] == 0
        assert saved["machine"]["threads"] >= 1
        assert "lightning-memrl validate" in saved["eval_command"] and "conv-b" in saved["eval_command"]
        assert len((out / arm / "predictions.jsonl").read_text().splitlines()) == 1
    full = results["sft+grpo_manager+grpo_answerer"]
    assert [s["stage"] for s in full["stages"]] == ["sft", "grpo_manager", "grpo_answerer"]
    assert results["base"]["stages"] == [] and [s["stage"] for s in results["sft"]["stages"]] == ["sft"]
    manager, answerer = (work / "grpo_manager" / "adapter"), (work / "grpo_answerer" / "adapter")
    assert (manager / "adapter_config.json").is_file() and (answerer / "adapter_config.json").is_file()
    fit = full["stages"][2]["commands"][0]  # the answerer trains from the SFT adapter against the trained manager
    assert "lora.frozen_adapter_name_or_path work/grpo_manager/adapter" in fit and "stage answerer" in fit
    assert "lora.adapter_name_or_path work/sft/adapter" in fit and "locomo_path $LOCOMO " in fit
    assert "--config configs/memory_r1/locomo.yaml " in fit
    assert "lightning_memrl.rewards.TokenF1" in fit and "--model.init_args.grpo.group_size 3" in fit
    assert "grpo.kl_coef 0.05 --model.init_args.lora.reference_adapter_name_or_path work/sft/adapter" in fit
    rows = (work / "grpo_answerer" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert "train/reward/f1" in rows[0]  # the stage trained on the F1 reward
    assert "train/kl" in rows[0]  # with a KL term, against the SFT adapter
    assert "lora.frozen_adapter_name_or_path work/grpo_manager/adapter" in full["eval_command"]
    assert "lora.adapter_name_or_path work/grpo_answerer/adapter" in full["eval_command"]
    calls = []
    monkeypatch.setattr(bench, "_run", lambda *a: calls.append(a))
    again = bench.main(argv)
    assert calls == [] and again == results  # finished stages and arms are skipped, not rerun
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == set(results) and summary["caps"]["sft_steps"] == 1
    paired = summary["paired_vs_sft"]  # question by question against the warm start
    assert set(paired) == set(results) - {"sft"}
    for arm, comparison in paired.items():
        for metric in ("exact_match", "f1"):
            difference = results[arm]["overall"][metric] - results["sft"]["overall"][metric]
            pair = comparison[metric]
            assert pair["pairs"] == 1 and pair["mean_difference"] == pytest.approx(difference)
    bench.main([*argv, "--arms", "base"])  # one arm asked for: the summary keeps the others
    assert calls == [] and set(json.loads((out / "summary.json").read_text())["arms"]) == set(results)
