"""Benchmark plumbing (no timing): a side's worker gets the driver's options back; the comparison table."""

from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from lightning_memrl import GenerationSettings

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
    assert result["read_bandwidth_gb_s"] == max(result["read_bandwidth_readings_gb_s"])  # the faster reading
    bandwidth = result["read_bandwidth_gb_s"] * 1e9
    assert fp32["floor_ms"] == pytest.approx(fp32["weights_mib"] * 2**20 / bandwidth * 1e3)
    for row in (fp32, bf16):
        assert 0 < row["bare_ms"] < 1e4
        timed = ("engine_ms", "engine_reserved_ms", "engine_unreserved_ms", "engine_lora_ms", "loop_static_ms")
        for key in timed:  # differences of two timings
            assert math.isfinite(row[key]), key
        assert row["engine_over_bare"] == pytest.approx(row["engine_ms"] / row["bare_ms"])
        assert row["engine_over_floor"] == pytest.approx(row["engine_ms"] / row["floor_ms"])
        assert row["loop_over_engine"] == pytest.approx(row["loop_static_ms"] / row["engine_ms"])
        assert row["lora_copies_mib"] > 0  # merged weights (fp32) or stacked factors (bf16)


def test_decode_compile_reports_the_compiled_step_and_its_warm_up(bench, monkeypatch, tmp_path):
    bu, _ = bench
    decode = importlib.import_module("decode")
    monkeypatch.setattr(bu, "RESULTS", tmp_path)
    compile_options, compiled_calls, real_compile = [], [], torch.compile

    def spy_compile(fn, **options):  # the step the benchmark times must be the compiled one
        compile_options.append(options)
        compiled = real_compile(fn, **options)
        return lambda *args, **kwargs: compiled_calls.append(1) or compiled(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy_compile)
    argv = ["--model", "tiny", "--steps", "3", "--repeats", "1", "--prompt_tokens", "8", "--batch", "2"]
    result = decode.main([*argv, "--bandwidth_mib", "16", "--threads", "1", "--dtypes", "float32", "--compile"])
    row = result["dtypes"]["float32"]
    assert result["work"]["compile"] is True and compile_options == [{"dynamic": False}]
    assert len(compiled_calls) == 2 * 3  # warm-up and one repeat of 3 + 1 new tokens: 3 decode steps each
    assert math.isfinite(row["loop_compiled_ms"]) and row["loop_compiled_warmup_s"] > 0  # the first call compiles


def test_bucketed_loop_reuses_one_cache_per_rounded_length(bench, tiny_model, tiny_tokenizer):
    decode = importlib.import_module("decode")

    def engine():
        return decode.BucketedLoop(tiny_model, tiny_tokenizer, cache="static", pack_weights=False)

    settings = GenerationSettings(temperature=1.0, max_new_tokens=5)
    prompts, others = [[5, 6, 7, 8], [9, 10, 11, 12]], [[20, 21, 22, 23], [24, 25, 26, 27]]
    reused = engine()
    reused.generate(others, settings, max_new_tokens=2)  # 4 + 2 columns: the 64-column cache, left holding keys
    torch.manual_seed(0)
    after_others = reused.generate(prompts, settings)  # 4 + 5 columns: the same cache, reset first
    assert list(reused.caches) == [64]
    torch.manual_seed(0)
    fresh = engine().generate(prompts, settings)
    assert [g.token_ids for g in after_others] == [g.token_ids for g in fresh]


def test_answer_tokens_splits_f1_into_precision_and_recall(bench, tmp_path, capsys):
    answer_tokens = importlib.import_module("answer_tokens")
    rows = [
        {"answer": "cat sat on mat", "answers": ["a cat on the mat"]},  # P 3/4, R 1, F1 6/7, 4 words
        {"answer": "cat", "answers": ["cat sat on mat"]},  # P 1, R 1/4, F1 2/5, 1 word
        {"answer": None, "answers": ["x"]},  # no parsed answer: counted, skipped
    ]
    arm = tmp_path / "arm"
    arm.mkdir()
    (arm / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = answer_tokens.main([str(arm), "--out", str(tmp_path / "tokens.json")])
    stats = result["arms"][str(arm)]
    assert (stats["questions"], stats["skipped"], stats["words"]) == (2, 1, 2.5)
    assert (stats["precision"], stats["recall"], stats["f1"]) == pytest.approx((7 / 8, 5 / 8, (6 / 7 + 2 / 5) / 2))
    assert json.loads((tmp_path / "tokens.json").read_text()) == result
    with pytest.raises(SystemExit, match="no predictions.jsonl in .*missing"):
        answer_tokens.main([str(tmp_path / "missing")])


def test_rollout_backend_option_reaches_the_worker(bench, tiny_model, tiny_tokenizer):
    rollout = importlib.import_module("rollout")
    from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
    from lightning_memrl.rollout.hf import RolloutEngine

    args = rollout.parse_args(["--model", "tiny", "--backend", "decode_loop", "--cache", "dynamic"])
    worker = rollout.parse_args([f"--{k}={getattr(args, k)}" for k in rollout.EPISODE_KEYS] + ["--worker", "ours"])
    engine = rollout.build_engine(worker, tiny_model, tiny_tokenizer)
    assert type(engine) is DecodeLoopEngine and (engine.cache, engine.drop_finished) == ("dynamic", True)
    default = rollout.parse_args(["--model", "tiny"])
    assert type(rollout.build_engine(default, tiny_model, tiny_tokenizer)) is RolloutEngine


def test_ablation_composes_overlays_without_dropping_the_base_rewards(bench):

    ablation = importlib.import_module("ablation")
    root = BENCHMARKS.parent
    base = yaml.safe_load((root / "configs" / "memagent" / "multichunk.yaml").read_text())
    tiny = yaml.safe_load(ablation.TINY.read_text())
    stack = yaml.safe_load((ablation.CREDIT / "stack_of_three.yaml").read_text())
    config, _ = ablation.compose_arm(base, stack, tiny, "stack_of_three.yaml")
    rewards = config["model"]["init_args"]["rewards"]
    assert rewards[:2] == base["model"]["init_args"]["rewards"]  # the multichunk rewards stay, bare_answer too
    assert rewards[2]["class_path"].endswith("CompressionReward") and len(rewards) == 3
    callbacks = [c["class_path"].rsplit(".", 1)[1] for c in config["trainer"]["callbacks"]]
    assert callbacks == ["ModelCheckpoint", "BoundedReward", "HindsightMemoryCredit"]  # no tiny OverlongPenalty
    assert config["trainer"]["callbacks"][0] == base["trainer"]["callbacks"][0]  # the base checkpoint folder
    info_gain = yaml.safe_load((ablation.CREDIT / "info_gain.yaml").read_text())
    info, notes = ablation.compose_arm(base, info_gain, tiny, "x")
    assert info["trainer"]["callbacks"][1]["init_args"]["answer_pattern"] == r"\b\d{4}\b" and notes
    with pytest.raises(SystemExit, match=r"bad.yaml: sets the list model.init_args.generation.stop_strings"):
        ablation.compose_arm(base, {"model": {"init_args": {"generation": {"stop_strings": ["x"]}}}}, tiny, "bad.yaml")


def test_ablation_saves_file_options_relative_to_the_repository(bench):
    ablation = importlib.import_module("ablation")
    config_path = BENCHMARKS.parent / "configs" / "memagent" / "multichunk.yaml"
    run_config = ablation._absolute_paths(yaml.safe_load(config_path.read_text()), config_path.parent)
    lora = run_config["model"]["init_args"]["lora"]
    assert Path(lora).is_absolute() and Path(lora).is_file()  # what the run reads, from any folder
    saved = ablation._repo_relative_paths(run_config)
    assert saved["model"]["init_args"]["lora"] == "configs/shared/smollm2_lora.yaml"
    assert saved["trainer"] == run_config["trainer"]  # nothing else changes


def test_ablation_runs_two_arms_and_skips_finished_ones(bench, tmp_path, monkeypatch):
    ablation = importlib.import_module("ablation")
    monkeypatch.chdir(BENCHMARKS.parent)
    argv = ["--config", "configs/memagent/tiny.yaml", "--arms", "base", "grpo", "--max_steps", "1"]
    argv += ["--val_tasks", "4", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--in_process"]
    summary = ablation.main(argv)
    assert set(summary["arms"]) == {"base", "grpo"}
    saved = json.loads((tmp_path / "summary.json").read_text())["arms"]["grpo"]
    assert saved["exact_match_min"] <= saved["exact_match"] <= saved["exact_match_max"] and saved["seeds"] == [0]
    assert saved["by_answer_position"] and saved["by_num_chunks"] and saved["step_time_s"] > 0
    paired, base_em = saved["paired"]["vs_base"], summary["arms"]["base"]["exact_match"]
    assert paired["pairs"] == 4 and "paired" not in summary["arms"]["base"]  # base is only a reference
    assert paired["mean_difference"] == pytest.approx(saved["exact_match"] - base_em)  # same 4 tasks, 1 seed
    assert paired["ci_low"] <= paired["mean_difference"] <= paired["ci_high"] and 0 < paired["sign_test_p"] <= 1
    for arm in ("base", "grpo"):
        result = json.loads((tmp_path / f"{arm}_seed0" / "result.json").read_text())
        assert result["overall"]["tasks"] == 4 and "by_answer_position" in result and "by_num_chunks" in result
        rows = (tmp_path / f"{arm}_seed0" / "predictions.jsonl").read_text().splitlines()
        assert len(rows) == 4 and all("memories" in json.loads(r) for r in rows)
    assert result["steps"] == 1 and result["step_time_s"] > 0  # the grpo arm trained one step
    assert (tmp_path / "grpo_seed0" / "metrics.csv").is_file()
    assert (tmp_path / "ablation_em.png").stat().st_size > 0 and (tmp_path / "retention.png").stat().st_size > 0
    table, targets = (tmp_path / "summary.md").read_text().split("\n\n", 1)
    table = table.splitlines()
    assert len(table) == 4 and table[2].startswith("| base | 0 | ") and table[3].startswith("| grpo | 0 | ")
    assert targets.startswith("Targets") and "plain GRPO +15 on 4-chunk tasks" in targets
    calls = []
    monkeypatch.setattr(ablation, "run_cli", lambda *a: calls.append(a))
    again = ablation.main(argv)
    assert calls == [] and again["arms"] == summary["arms"]  # finished arms are skipped, not rerun
    base_only = ablation.main([a for a in argv if a != "grpo"])
    assert calls == [] and base_only["arms"] == summary["arms"]  # the summary keeps earlier invocations' runs
    (tmp_path / "base_seed0" / "result.json").unlink()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(ablation, "summarise", lambda *a: {"arms": {}})
    monkeypatch.setattr(ablation, "run_arm", lambda arm, *a: calls.append((arm, os.environ.get("OMP_NUM_THREADS"))))
    ablation.main([*argv, "--threads", "3"])
    assert calls == [("base", "3")]  # only the unfinished run, with the threads asked for

    def stopped(*a):
        raise subprocess.CalledProcessError(143, ["lightning-memrl", "fit"])

    monkeypatch.setattr(ablation, "run_arm", stopped)
    with pytest.raises(
        SystemExit, match=r"base seed 0: the run stopped \(exit code 143\).*resumes it from its last step"
    ):
        ablation.main(argv)


def test_ablation_resumes_an_interrupted_run_from_its_last_step(bench, tmp_path, monkeypatch):
    ablation = importlib.import_module("ablation")
    monkeypatch.chdir(BENCHMARKS.parent)
    config = yaml.safe_load((BENCHMARKS.parent / "configs" / "memagent" / "tiny.yaml").read_text())
    extra = ["--data.synthetic_val.num_tasks", "4"]
    out, work = tmp_path / "grpo_seed0", tmp_path / "work" / "grpo_seed0"

    def interrupted(root):  # the fit finished its steps, then the invocation died before writing a result
        raise KeyboardInterrupt

    newest_report = ablation._newest_report
    monkeypatch.setattr(ablation, "_newest_report", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ablation.run_arm("grpo", 0, config, 1, extra, out, True, work)
    assert not (out / "result.json").exists() and list(work.glob("**/checkpoints/last.ckpt"))
    monkeypatch.setattr(ablation, "_newest_report", newest_report)
    result = ablation.run_arm("grpo", 0, config, 2, extra, out, True, work)
    assert result["resumed_from_step"] == 1 and result["steps"] == 2
    with (out / "metrics.csv").open() as f:  # both invocations' steps, each once
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("time/step_s")]
    assert sorted(steps) == [0, 1]
    assert not work.exists()  # a finished run leaves no work folder


def test_ablation_passes_sigterm_on_to_the_run(bench, tmp_path, monkeypatch):
    ablation = importlib.import_module("ablation")
    fake = tmp_path / "lightning-memrl"  # stands in for the CLI: on SIGTERM it notes it and exits as the CLI does
    fake.write_text(
        f"#!{sys.executable}\nimport signal, sys, time\n"
        "def stop(*a):\n    open('stopped', 'w').close()\n    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\nopen('started', 'w').close()\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(ablation.shutil, "which", lambda name: str(fake))

    def terminate_once_started():
        while not (tmp_path / "started").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_once_started, daemon=True).start()
    with pytest.raises(subprocess.CalledProcessError) as stopped:
        ablation.run_cli(["fit"], tmp_path)
    assert stopped.value.returncode == 143 and (tmp_path / "stopped").exists()
    assert signal.getsignal(signal.SIGTERM) == before  # this process's own handler is back


def test_ablation_work_folder_of_another_run_is_not_resumed(bench, tmp_path):
    ablation = importlib.import_module("ablation")
    work = tmp_path / "grpo_seed0"
    assert ablation.prepare_work(work, {"seed": 0}) is None
    (work / "logs" / "checkpoints").mkdir(parents=True)
    (work / "logs" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert ablation.prepare_work(work, {"seed": 0}) == work / "logs" / "checkpoints" / "last.ckpt"
    assert ablation.prepare_work(work, {"seed": 1}) is None and not (work / "logs").exists()


def test_ablation_merges_the_metrics_of_a_resumed_run(bench, tmp_path):
    ablation = importlib.import_module("ablation")
    first, second = tmp_path / "v0" / "metrics.csv", tmp_path / "v1" / "metrics.csv"
    first.parent.mkdir(), second.parent.mkdir()
    first.write_text("step,time/step_s\n0,10\n1,11\n2,12\n")  # died after step 2, last checkpoint at step 2
    second.write_text("step,time/step_s,val/em\n2,20,\n3,30,\n3,,0.5\n")
    os.utime(first, (1, 1))
    merged = ablation.merge_metrics(tmp_path, tmp_path / "merged.csv")
    with merged.open() as f:
        rows = [(r["step"], r["time/step_s"], r["val/em"]) for r in csv.DictReader(f)]
    assert rows == [("0", "10", ""), ("1", "11", ""), ("2", "20", ""), ("3", "30", ""), ("3", "", "0.5")]
    assert ablation.merge_metrics(tmp_path / "v2", tmp_path / "none.csv") is None


def test_credit_cost_composes_an_overlay_into_the_base_config_keeping_its_rewards(bench):
    credit_cost = importlib.import_module("credit_cost")
    quickstart = BENCHMARKS.parent / "configs" / "memagent" / "quickstart.yaml"
    config, _ = credit_cost.composed_config(quickstart, BENCHMARKS.parent / "examples" / "credit" / "tips.yaml")
    rewards = [
        (r["class_path"], (r.get("init_args") or {}).get("name")) for r in config["model"]["init_args"]["rewards"]
    ]
    assert rewards == [
        ("lightning_memrl.rewards.ExactMatch", None),
        ("lightning_memrl.rewards.ExactMatch", "bare_answer"),
    ]
    callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert callbacks == [
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lightning_memrl.credit.tips.PotentialTurnShaping",
    ]
    assert credit_cost.composed_config(quickstart, None)[0]["model"] == config["model"]  # tips adds only a callback


def test_grpo_step_ours_generates_exactly_new_tokens_as_trl(bench, tmp_path):
    """The comparison forces both sides to ``--new_tokens`` (TRL's ``min_new_tokens``), even where EOS is likely."""
    bu, grpo_step = bench
    ours = importlib.import_module("grpo_step_ours")
    args = grpo_step.parse_args(["--model", "tiny", "--group", "4", "--new_tokens", "6", "--dtype", "float32"])
    args.model_path = bu.resolve_model("tiny", tmp_path)
    module = ours.build_module(args, ours.SingleTurnWorkflow())
    eos = module.tokenizer.eos_token_id

    def eos_likely(layer, inputs, logits):  # EOS all but certain at every position
        return logits.index_add(-1, torch.tensor([eos]), torch.full((*logits.shape[:-1], 1), 30.0))

    module.policy.get_output_embeddings().register_forward_hook(eos_likely)
    generations = module.engine.generate([[5, 6, 7, 8]] * 4, module.generation)
    assert [len(g.token_ids) for g in generations] == [6] * 4
    unforced = module.engine.generate(
        [[5, 6, 7, 8]] * 4, dataclasses.replace(module.generation, generation_kwargs=None)
    )
    assert [len(g.token_ids) for g in unforced] == [1] * 4  # without it, EOS ends every row at once


def test_ablation_plots_paired_differences_only_for_arms_compared_with_grpo(bench, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = importlib.import_module("ablation_report")
    report.plot_paired({"base": {}, "grpo": {"paired": {"vs_base": {}}}}, tmp_path, plt)
    assert not (tmp_path / "paired.png").exists()  # nothing was compared with plain GRPO
    diff = {"mean_difference": 0.1, "ci_low": 0.02, "ci_high": 0.18, "sign_test_p": 0.02}
    report.plot_paired({"grpo": {}, "fine_mem": {"paired": {"vs_grpo": diff}}}, tmp_path, plt)
    assert (tmp_path / "paired.png").stat().st_size > 0


def test_ablation_summary_table_rows_in_percent(bench):
    report = importlib.import_module("ablation_report")
    entry = {
        "seeds": [0, 1],
        "exact_match": 0.5,
        "exact_match_min": 0.4,
        "exact_match_max": 0.6,
        "by_num_chunks": {"4": 0.25, "5": 0.75},
        "by_answer_position": {"1": 1.0, "2": 0.0},
        "by_hops": {"1": 0.5},
        "eval_memory_words": 20.04,
        "step_time_s": 61.25,
        "paired": {
            "vs_grpo": {
                "mean_difference": 0.1,
                "ci_low": -0.02,
                "ci_high": 0.2,
                "wins": 5,
                "losses": 2,
                "sign_test_p": 0.453,
                "pairs": 192,
            }
        },
    }
    row = report.summary_table({"x": entry}).splitlines()[2]
    paired = "+10.0 [-2.0, +20.0], 5/2, p=0.45 (192 pairs)"
    assert row == f"| x | 0, 1 | 50.0 (40.0–60.0) | {paired} | 25.0 / 75.0 | 100.0 / 0.0 | 50.0 | 20.0 | 61.2 |"


def _run(arm: str, seed: int, em: float, four: float, positions: dict[str, tuple[float, int]], step_s=None) -> dict:
    return {
        "arm": arm,
        "seed": seed,
        "steps": 40,
        "overall": {"exact_match": em},
        "by_num_chunks": {"4": {"exact_match": four, "tasks": 20}},
        "by_answer_position": {k: {"exact_match": v, "tasks": n} for k, (v, n) in positions.items()},
        "step_time_s": step_s,
    }


def test_ablation_targets_read_from_hand_made_runs(bench):
    report = importlib.import_module("ablation_report")
    flat = {"1": (0.5, 10), "2": (0.5, 10), "3": (0.0, 2)}  # position 3 holds too few tasks to count
    results = [
        _run("base", 0, 0.2, 0.30, flat),
        _run("base", 1, 0.2, 0.20, flat),
        _run("grpo", 0, 0.5, 0.50, {"1": (0.9, 10), "2": (0.6, 10)}, step_s=60.0),  # 40 min of training
        _run("grpo", 1, 0.3, 0.30, {"1": (0.7, 10), "2": (0.4, 10)}, step_s=90.0),  # 60 min
        _run("x", 0, 0.7, 0.7, {"1": (0.6, 10), "2": (0.55, 10), "3": (0.0, 2)}),
        _run("x", 1, 0.6, 0.7, {"1": (0.6, 10), "2": (0.55, 10), "3": (0.0, 2)}),
        _run("y", 0, 0.9, 0.9, flat),  # best single run, but one seed: not a candidate
    ]
    arms = {a: {"seeds": [], "exact_match": 0.0} for a in ("base", "grpo", "x", "y")}
    for a in arms:
        ems = [r["overall"]["exact_match"] for r in results if r["arm"] == a]
        arms[a] = {"seeds": list(range(len(ems))), "exact_match": sum(ems) / len(ems)}
        arms[a] |= {"exact_match_min": min(ems), "exact_match_max": max(ems)}
    targets = report.target_readings(results, arms)
    g = targets["grpo_4_chunk_gain"]
    assert g["gain_per_seed"] == pytest.approx([0.20, 0.10]) and g["gain"] == pytest.approx(0.15)
    assert g["train_minutes"] == pytest.approx(50.0) and g["met"]  # +15 points in 50 minutes
    b = targets["best_over_grpo"]
    assert b["arm"] == "x" and b["gain"] == pytest.approx(0.25) and b["outside_seed_spread"] and b["met"]
    r = targets["retention"]
    assert r["grpo"]["positions"] == ["1", "2"] and r["grpo"]["spread"] == pytest.approx(0.3) and not r["grpo"]["met"]
    assert r["x"]["spread"] == pytest.approx(0.05) and r["x"]["first_minus_last"] == pytest.approx(0.05)
    assert r["x"]["met"] and "base" not in r
    arms["x"]["exact_match_min"] = 0.5  # touches plain GRPO's best seed
    assert not report.target_readings(results, arms)["best_over_grpo"]["met"]
    text = report.targets_text(targets)
    assert "+15.0 (seeds +20.0 / +10.0), 50 min of training: met" in text
    assert "x (2 seeds) +25.0, seed ranges apart: met" in text
    assert (
        "retention flat within 10 (grpo): range 30.0 over answer positions 1, 2 (first − last +30.0): not met" in text
    )


def test_ablation_targets_not_measurable_without_their_runs(bench):
    report = importlib.import_module("ablation_report")
    targets = report.target_readings([], {})
    assert targets == {"grpo_4_chunk_gain": None, "best_over_grpo": None, "retention": {}}
    assert report.targets_text(targets).count("not measurable") == 2


def test_grpo_step_reports_peak_above_post_import_over_weights(bench):
    _, grpo_step = bench
    args = grpo_step.parse_args(["--group", "2", "--new_tokens", "3", "--warmup", "0"])
    step = {"rollout_s": 1.0, "reference_s": 0.5, "update_s": 2.0, "step_s": 4.0, "other_s": 0.5}
    step["generated_tokens"] = 6.0
    raw = {
        "ours": {
            "steps": [step],
            "settings": "",
            "prompt_ids": [1, 2],
            "model_mib": 200.0,
            "loaded_rss_mib": 700.0,
            "peak_rss_mib": 1100.0,
            "post_import_rss_mib": 500.0,
        }
    }
    ours = grpo_step.side_results(args, raw)["ours"]
    assert ours["peak_over_weights"] == pytest.approx((1100 - 500) / 200)  # 3.0: the memory target reads 1.5
    assert ours["post_import_rss_mib"] == 500.0


def test_machine_names_the_allocator_a_run_uses(bench, monkeypatch):
    bu, _ = bench
    from lightning_memrl import preload

    for name in ("LD_PRELOAD", "LIGHTNING_MEMRL_MALLOC", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(preload, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    assert bu.allocator() == "glibc, LIGHTNING_MEMRL_MALLOC=unset (trim)"  # a worker process is not restarted
    assert bu.allocator(cli=True) == "tcmalloc (/lib/libtcmalloc_minimal.so.4), the CLI's choice"
    monkeypatch.setenv("LIGHTNING_MEMRL_MALLOC", "phases")
    assert bu.allocator(cli=True) == "glibc, LIGHTNING_MEMRL_MALLOC=phases"
    monkeypatch.setenv("LD_PRELOAD", "/lib/libjemalloc.so.2")
    assert bu.allocator() == "LD_PRELOAD=/lib/libjemalloc.so.2"
    assert bu.machine(2, cli=True)["allocator"] == "LD_PRELOAD=/lib/libjemalloc.so.2"
