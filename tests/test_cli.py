"""The real ``lightning-memrl`` entry point: fit, resume, validate, print_config, help, errors."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_memrl.models import build_tiny_model, build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "memagent" / "tiny.yaml")


def _cli(*args: str, cwd: Path, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    exe = Path(sys.executable).with_name("lightning-memrl")
    proc = subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return proc


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    return proc


def _logs(tmp_path: Path) -> Path:
    """configs/memagent/tiny.yaml writes logs and checkpoints under logs/tiny of the working directory."""
    return tmp_path / "logs" / "tiny"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fit")
    _ok(_cli("fit", "--config", TINY, "--trainer.max_steps", "3", cwd=tmp_path))
    return tmp_path


def test_fit_changes_parameters_and_logs_metrics(trained):
    ckpt_path = _logs(trained) / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    initial = build_tiny_model(build_tiny_tokenizer(), seed=0).state_dict()
    trained_weights = {k.removeprefix("policy."): v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    assert set(trained_weights) == set(initial)
    changed = [k for k in initial if not torch.equal(initial[k], trained_weights[k])]
    assert len(changed) > len(initial) // 2, changed
    rows = list(csv.DictReader(open(next((_logs(trained) / "csv").glob("version_*/metrics.csv")))))
    train_rows = [r for r in rows if r.get("train/reward")]
    assert len(train_rows) == 3
    for key in (
        "train/reward",
        "train/kl",
        "train/entropy",
        "train/clip_frac",
        "train/memory_length",
        "train/frac_reward_zero_std",
        "time/rollout_s",
        "time/update_s",
        "train/reward/exact_match",
    ):
        assert all(r[key] != "" for r in train_rows), key
    assert float(train_rows[-1]["train/entropy"]) > 0
    assert list((_logs(trained) / "tb").glob("version_*/events.out.tfevents.*"))
    assert ckpt["memrl_workflow"]["memory"]["writes"] > 0
    overlong = ckpt["callbacks"][next(k for k in ckpt["callbacks"] if "OverlongPenalty" in k)]
    assert overlong["penalised_turns"] > 0  # the config's soft buffer (answers over 8 tokens) lies below the cap
    assert all(float(r["train/nonfinite_rewards"]) == 0 and float(r["train/skipped_steps"]) == 0 for r in train_rows)


def test_resume_restores_optimizer_scheduler_step_and_callback_state(trained, tmp_path):
    first = torch.load(_logs(trained) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    _ok(
        _cli(
            "fit",
            "--config",
            TINY,
            "--trainer.max_steps",
            "5",
            "--ckpt_path",
            str(_logs(trained) / "checkpoints" / "last.ckpt"),
            cwd=tmp_path,
        )
    )
    resumed = torch.load(_logs(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 5
    adam_steps = {float(s["step"]) for s in resumed["optimizer_states"][0]["state"].values()}
    assert adam_steps == {5.0}  # AdamW moments continued from step 3, not restarted
    assert resumed["lr_schedulers"][0]["last_epoch"] == 5
    memory_before = first["memrl_workflow"]["memory"]["writes"]
    assert resumed["memrl_workflow"]["memory"]["writes"] > memory_before > 0
    key = next(k for k in resumed["callbacks"] if "MemoryTokenCredit" in k)
    assert resumed["callbacks"][key]["credited_turns"] > first["callbacks"][key]["credited_turns"] > 0


def test_user_callback_composed_from_yaml(tmp_path):
    import yaml

    extra = yaml.safe_load((REPO / "examples" / "custom_callbacks.yaml").read_text())
    bonus = next(c for c in extra["trainer"]["callbacks"] if c["class_path"].endswith("ConciseMemoryBonus"))
    # the random tiny model fills its memory budget, so "under half of it" never happens: count every
    # memory turn instead, which makes the expected count known (one per memory write)
    bonus["init_args"]["fraction"] = 2.0
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump(extra))
    _ok(
        _cli(
            "fit",
            "--config",
            TINY,
            "--config",
            str(tmp_path / "extra.yaml"),
            "--trainer.max_steps",
            "2",
            "--trainer.num_sanity_val_steps",
            "0",  # no validation rollouts: every memory write is a training turn
            cwd=tmp_path,
            extra_path=str(REPO / "examples"),
        )
    )
    ckpt = torch.load(_logs(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    names = list(ckpt["callbacks"])
    assert any("ConciseMemoryBonus" in n for n in names) and any("OverlongPenalty" in n for n in names)
    state = ckpt["callbacks"][next(n for n in names if "ConciseMemoryBonus" in n)]
    assert set(state) == {"rewarded_turns"}
    assert state["rewarded_turns"] == ckpt["memrl_workflow"]["memory"]["writes"] > 0  # called on every step's turns
    assert ckpt["callbacks"][next(n for n in names if "OverlongPenalty" in n)]["penalised_turns"] > 0


def test_advantage_estimator_chosen_from_yaml(tmp_path):
    _ok(
        _cli(
            "fit",
            "--config",
            TINY,
            "--config",
            str(REPO / "examples" / "custom_advantages.yaml"),
            "--trainer.max_steps",
            "1",
            "--trainer.num_sanity_val_steps",
            "0",
            cwd=tmp_path,
            extra_path=str(REPO / "examples"),
        )
    )
    ckpt = torch.load(_logs(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1
    # the example's class replaced configs/memagent/tiny.yaml's GroupRelative, whose init_args were dropped with it
    assert ckpt["hyper_parameters"]["advantage"] == {"class_path": "custom_advantages.RLOO"}
    rows = list(csv.DictReader(open(next((_logs(tmp_path) / "csv").glob("version_*/metrics.csv")))))
    assert [r["train/advantage_abs"] != "" for r in rows if r.get("train/reward")] == [True]


def test_validate_prints_metrics(trained, tmp_path):
    proc = _ok(
        _cli(
            "validate", "--config", TINY, "--ckpt_path", str(_logs(trained) / "checkpoints" / "last.ckpt"), cwd=tmp_path
        )
    )
    assert "val/exact_match" in proc.stdout and "val/f1" in proc.stdout


def test_print_config_and_help(tmp_path):
    proc = _ok(_cli("fit", "--config", TINY, "--print_config", cwd=tmp_path))
    for key in (
        "kl_estimator: low_var_kl",
        "loss_aggregation: token_mean",
        "class_path: lightning_memrl.MemRLModule",
        "max_memory_tokens: 16",
        "OverlongPenalty",
    ):
        assert key in proc.stdout, key
    top = _ok(_cli("--help", cwd=tmp_path)).stdout
    assert "fit" in top and "validate" in top
    model_help = _ok(_cli("fit", "--model.help", "lightning_memrl.MemRLModule", cwd=tmp_path)).stdout
    assert "--model.grpo.help" in model_help and "GRPO options" in model_help
    assert "policy as a hub id or local path" in model_help  # docstrings become --help


def test_bad_data_row_stops_with_file_row_and_field(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(
        '{"question": "q?", "context": ["c"], "answers": ["a"]}\n{"question": "", "context": "c", "answers": "a"}\n'
    )
    proc = _cli("fit", "--config", TINY, "--data.init_args.train_path", str(bad), cwd=tmp_path)
    assert proc.returncode != 0
    assert f"{bad}: row 1 (line 2): field 'question'" in proc.stderr


def test_missing_model_stops_with_the_option_name(tmp_path):
    proc = _cli("fit", "--config", TINY, "--model.init_args.model_name_or_path", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode != 0
    assert "model_name_or_path" in proc.stderr and "nope" in proc.stderr


def test_validate_writes_report_and_plot_writes_pngs(trained, tmp_path):
    proc = _ok(
        _cli(
            "validate", "--config", TINY, "--ckpt_path", str(_logs(trained) / "checkpoints" / "last.ckpt"), cwd=tmp_path
        )
    )
    assert "exact_match" in proc.stdout and "chunks" in proc.stdout and "all" in proc.stdout
    (report_path,) = list(_logs(tmp_path).glob("**/eval_report_step3.json"))  # the checkpoint's step
    import json

    report = json.loads(report_path.read_text())
    by_chunks = report["by_num_chunks"]
    assert sum(r["tasks"] for r in by_chunks.values()) == report["overall"]["tasks"] == 4  # limit_val_batches=1 x 4
    assert set(by_chunks) <= {"2", "3"}
    predictions = [json.loads(line) for line in (report_path.parent / "eval_predictions_step3.jsonl").open()]
    assert len(predictions) == 4  # one line per evaluated task
    for row in predictions:
        assert len(row["memories"]) == row["chunks"]  # the memory after each chunk
        assert row["exact_match"] in (0.0, 1.0) and isinstance(row["completion"], str) and row["answers"]
    em = sum(row["exact_match"] for row in predictions) / len(predictions)
    assert em == pytest.approx(report["overall"]["exact_match"])
    plotted = _ok(
        _cli("plot", str(trained / "logs"), "--reports", str(report_path), "--out", str(tmp_path / "png"), cwd=tmp_path)
    )
    for name in ("learning_curves.png", "evaluation.png"):
        png = tmp_path / "png" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    assert "wrote" in plotted.stdout


def test_quickstart_config_resolves_to_the_measured_recipe(tmp_path):
    """configs/memagent/quickstart.yaml parses; the keys its README numbers depend on are what they say."""
    import yaml

    proc = _ok(
        _cli("fit", "--config", str(REPO / "configs" / "memagent" / "quickstart.yaml"), "--print_config", cwd=tmp_path)
    )
    config = yaml.safe_load(proc.stdout)
    model = config["model"]["init_args"]
    assert model["model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and model["dtype"] == "auto"
    assert model["grpo"]["kl_coef"] == 0.0 and model["optimizer"]["lr"] == 2.0e-4
    assert model["answer_pattern"] == r"\b\d{4}\b"
    data = config["data"]["init_args"]
    assert data["synthetic"]["seed"] != data["synthetic_val"]["seed"]  # held-out tasks
    assert config["trainer"]["max_steps"] == 20


def test_plot_places_evaluations_at_their_checkpoint_step_and_falls_back_to_entropy(tmp_path):
    from lightning_memrl import plot

    reports = [
        {"step": 20, "overall": {"exact_match": 0.8}},  # validate --ckpt_path of the step-20 checkpoint
        {"step": 0, "overall": {"exact_match": 0.5}},
        {"step": 20, "overall": {"exact_match": 0.75}},  # a later report of the same step wins
    ]
    assert plot.evaluation_points(reports) == [(0, 0.5), (20, 0.75)]
    series = {"train/reward": [(0, 0.2), (1, 0.4)], "train/entropy": [(0, 0.7), (1, 0.6)]}  # no train/kl
    out = plot.plot_learning_curves(series, tmp_path / "curves.png", plot.evaluation_points(reports))
    assert out.read_bytes()[:4] == b"\x89PNG"
    kl_panel = plot.CURVES[1]
    assert plot.panel_metric(kl_panel, series)[0] == "train/entropy"
    assert plot.panel_metric(kl_panel, {**series, "train/kl": [(0, 0.01)]})[0] == "train/kl"
    assert plot.panel_metric(kl_panel, {})[0] == "train/kl"  # drawn as "not logged"
