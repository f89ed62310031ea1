"""Benchmark plumbing (no timing): a side's worker gets the driver's options back; the comparison table."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other as top-level modules
    return importlib.import_module("bench_utils"), importlib.import_module("grpo_step")


def test_grpo_step_worker_parses_the_driver_options(bench):
    _, grpo_step = bench
    argv = ["--model", "tiny", "--group", "4", "--lora_r", "8", "--dtype", "float32", "--precision", "32-true"]
    args = grpo_step.parse_args([*argv, "--trl_precision", "fp32", "--steps", "3", "--ours_kwargs", '{"a": 1}'])
    worker = grpo_step.parse_args(grpo_step.worker_argv(args, "/models/tiny"))
    assert vars(worker) == {**vars(args), "model_path": "/models/tiny"}
    assert sorted(grpo_step.WORKERS) == ["ours", "trl"] and all(p.is_file() for p in grpo_step.WORKERS.values())


def test_comparison_table_rows_and_ratio_column(bench):
    bu, _ = bench
    results = {"ours": {"step_s": 1.0, "rss": 10.0}, "trl": {"step_s": 4.0, "rss": 20.0}}
    names = {"ours": "ours", "trl": "TRL"}
    labels = {"step_s": "step (s)", "rss": "RSS"}
    headers, rows = bu.comparison_table(labels, results, ["ours", "trl"], {"step_s": 0.25}, names, "ours / TRL")
    assert headers == ["", "ours", "TRL", "ours / TRL"]
    assert rows[0] == ["step (s)", 1.0, 4.0, 0.25]
    assert rows[1][:3] == ["RSS", 10.0, 20.0] and math.isnan(rows[1][3])  # no ratio for this row
    headers, rows = bu.comparison_table(labels, results, ["trl"], {}, names, "ours / TRL")
    assert headers == ["", "TRL"] and rows == [["step (s)", 4.0], ["RSS", 20.0]]


def test_credit_cost_times_every_credit_overlay_or_the_named_ones(bench):
    credit_cost = importlib.import_module("credit_cost")
    every = credit_cost.overlays(None)
    assert [p.stem for p in every] == sorted(p.stem for p in (BENCHMARKS.parent / "examples" / "credit").glob("*.yaml"))
    assert [p.stem for p in credit_cost.overlays(["tips", "gspo"])] == ["tips", "gspo"]  # in the order given
    with pytest.raises(SystemExit, match=r"no examples/credit/<name>.yaml for \['nope'\]"):
        credit_cost.overlays(["tips", "nope"])


def test_credit_cost_append_keeps_earlier_runs_and_divides_by_each_sessions_base(bench, tmp_path):
    credit_cost = importlib.import_module("credit_cost")
    earlier = {"config": "q.yaml", "steps": 1, "machine": {"cpu": "a"}, "runs": {"(none)": {"time/step_s": 100.0}}}
    earlier["runs"]["gspo"] = {"time/step_s": 90.0}
    path = tmp_path / "credit_cost_q.json"
    path.write_text(json.dumps(earlier))
    result = credit_cost.earlier_result(path, {"config": "q.yaml", "steps": 1, "machine": {"cpu": "b"}})
    assert [s["base"] for s in result["sessions"]] == ["(none)", "(none) session 2"]
    assert result["sessions"][0] == {"machine": {"cpu": "a"}, "base": "(none)", "runs": ["gspo"]}
    result["runs"]["(none) session 2"] = {"time/step_s": 50.0}
    result["runs"]["tips"] = {"time/step_s": 60.0}
    result["sessions"][-1]["runs"].append("tips")
    ratios = {row[0]: row[-1] for row in credit_cost.cost_table(result)}
    assert ratios == {"(none)": 1.0, "gspo": 0.9, "(none) session 2": 1.0, "tips": 1.2}  # 90/100 and 60/50
    with pytest.raises(SystemExit, match="--append: .* holds --config q.yaml --steps 1; run the same"):
        credit_cost.earlier_result(path, {"config": "q.yaml", "steps": 2, "machine": {}})


def test_decode_reports_floor_bare_and_engine_steps_per_dtype(bench, monkeypatch, tmp_path):
    bu, _ = bench
    decode = importlib.import_module("decode")
    monkeypatch.setattr(bu, "RESULTS", tmp_path)
    argv = ["--model", "tiny", "--steps", "3", "--repeats", "1", "--prompt_tokens", "8", "--batch", "2"]
    result = decode.main([*argv, "--bandwidth_mib", "16", "--lora_r", "2", "--threads", "1"])
    assert result == json.loads((tmp_path / "decode_tiny.json").read_text())
    assert result["read_bandwidth_gb_s"] > 0 and isinstance(result["machine"]["cpu_flags"], list)
    assert sorted(result["dtypes"]) == ["bfloat16", "float32"]
    fp32, bf16 = result["dtypes"]["float32"], result["dtypes"]["bfloat16"]
    assert fp32["weights_mib"] == pytest.approx(2 * bf16["weights_mib"], rel=0.01)  # every weight once, in its dtype
    bandwidth = result["read_bandwidth_gb_s"] * 1e9
    assert fp32["floor_ms"] == pytest.approx(fp32["weights_mib"] * 2**20 / bandwidth * 1e3)
    for row in (fp32, bf16):
        assert 0 < row["bare_ms"] < 1e4
        for key in ("engine_ms", "engine_lora_merged_ms", "engine_lora_unmerged_ms"):  # differences of two timings
            assert math.isfinite(row[key]), key
        assert row["engine_over_bare"] == pytest.approx(row["engine_ms"] / row["bare_ms"])
        assert row["lora_merged_mib"] > 0
