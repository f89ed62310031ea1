"""The ``lightning-memrl`` entry point in this process: where a run's outputs go, failed runs, ``--ckpt_path``
with model options that differ from the checkpoint's, options that do nothing here, ``--help``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_cli import TINY

from lightning_memrl import ckpt_options, cli
from lightning_memrl.errors import ConfigError

ONE_STEP = ["--trainer.max_steps", "1", "--trainer.num_sanity_val_steps", "0"]


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``lightning-memrl ARGS``; return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["lightning-memrl", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as stop:
        code = stop.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def run_elsewhere(tmp_path_factory) -> tuple[Path, Path, Path]:
    """One step of the tiny config with ``--trainer.default_root_dir``: (working directory, root given, last.ckpt)."""
    work = tmp_path_factory.mktemp("work")
    root = tmp_path_factory.mktemp("elsewhere") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        args = ["fit", "--config", TINY, *ONE_STEP, "--trainer.default_root_dir", str(root)]
        patch.setattr(sys, "argv", ["lightning-memrl", *args])
        cli.main()
    (ckpt,) = [*root.glob("**/last.ckpt"), *work.glob("**/last.ckpt")]  # the ckpt_path tests need it wherever it is
    return work, root, ckpt


def test_default_root_dir_moves_logs_and_checkpoints(run_elsewhere):
    work, root, _ = run_elsewhere
    assert not (work / "logs").exists()  # configs/memagent/tiny.yaml's default_root_dir (logs/tiny) is replaced
    (metrics,) = (root / "csv").glob("version_*/metrics.csv")
    assert "train/reward" in metrics.read_text()
    assert list((root / "tb").glob("version_0/events.out.tfevents.*"))
    assert (root / "csv" / "version_0" / "config.yaml").is_file()
    ckpt = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1


def test_failed_run_leaves_no_version_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs" / "tiny" / "csv" / "version_0").mkdir(parents=True)  # an earlier run's folder stays
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "", "context": "c", "answers": "a"}\n')
    code, _, err = _main(monkeypatch, capsys, "fit", "--config", TINY, "--data.init_args.train_path", str(bad))
    assert code == 2 and "field 'question'" in err
    assert sorted(p.name for p in (tmp_path / "logs" / "tiny").iterdir()) == ["csv"]  # tb/ was made by the run
    assert [p.name for p in (tmp_path / "logs" / "tiny" / "csv").iterdir()] == ["version_0"]


def test_ckpt_path_applies_a_workflow_option_with_a_warning(run_elsewhere, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["validate", "--config", TINY, "--ckpt_path", str(run_elsewhere[2])]
    args += ["--model.init_args.workflow.init_args.max_chunks", "1", "--trainer.limit_val_batches", "1"]
    args += ["--data.init_args.val_batch_size", "2", "--trainer.default_root_dir", str(tmp_path / "val")]
    with pytest.warns(UserWarning, match=r"workflow\.init_args\.max_chunks=1 \(checkpoint: 4\)"):
        code, _, err = _main(monkeypatch, capsys, *args)
    assert code == 0, err
    (predictions,) = (tmp_path / "val").glob("csv/version_0/eval_predictions_step1.jsonl")
    rows = [json.loads(line) for line in predictions.open()]
    assert len(rows) == 2 and all(row["chunks"] == 1 for row in rows)  # the tasks have 2-3 chunks; 1 was read


def test_ckpt_path_refuses_options_that_change_the_weights(run_elsewhere, tmp_path, monkeypatch, capsys):
    _, _, ckpt = run_elsewhere
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", TINY, "--ckpt_path", str(ckpt), *ONE_STEP]
    args += ["--model.init_args.lora", "{r: 4, alpha: 8}", "--model.init_args.dtype", "bfloat16"]
    code, _, err = _main(monkeypatch, capsys, *args)
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "model.init_args.lora (checkpoint: None" in line and "model.init_args.dtype (checkpoint: 'float32'" in line
    assert not (tmp_path / "logs").exists()
    last = ["fit", "--config", TINY, "--ckpt_path", "last", "--trainer.default_root_dir", str(ckpt.parents[1])]
    code, _, err = _main(monkeypatch, capsys, *last, "--model.init_args.lora", "{r: 4}")
    assert code == 2 and f"--ckpt_path {ckpt}:" in err and "model.init_args.lora (checkpoint: None" in err


def test_options_restored_on_resume_are_refused_by_fit_only():
    found = {"model.init_args.optimizer.lr": (1e-3, 1e-4), "model.init_args.generation.init_args.top_p": (1.0, 0.9)}
    with pytest.raises(ConfigError, match=r"optimizer\.lr \(checkpoint: 0\.001, given: 0\.0001"):
        ckpt_options.check_conflicts(found, "last.ckpt", "fit")
    warning = ckpt_options.check_conflicts(found, "last.ckpt", "validate")
    assert "optimizer.lr=0.0001 (checkpoint: 0.001)" in warning and "top_p=0.9 (checkpoint: 1.0)" in warning
    assert ckpt_options.check_conflicts({}, "last.ckpt", "fit") == ""


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--optimizer", "Adam"], "model.init_args.optimizer"),
        (["--optimizer.lr=0.1"], "model.init_args.optimizer"),
        (["--lr_scheduler", "StepLR"], "model.init_args.optimizer (warmup_steps"),
        (["--trainer.gradient_clip_val", "1.0"], "model.init_args.grpo.max_grad_norm"),
        (["--trainer.accumulate_grad_batches", "2"], "model.init_args.grpo.micro_batch_tokens"),
    ],
    ids=["optimizer", "optimizer.lr", "lr_scheduler", "gradient_clip_val", "accumulate_grad_batches"],
)
def test_options_that_do_nothing_here_name_the_replacement(tmp_path, monkeypatch, capsys, args, named):
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(monkeypatch, capsys, "fit", "--config", TINY, *args)
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert named in line
    assert not (tmp_path / "logs").exists()


def test_optimizer_in_a_config_file_names_the_replacement(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "opt.yaml").write_text("optimizer:\n  class_path: torch.optim.SGD\n  init_args:\n    lr: 0.1\n")
    code, _, err = _main(monkeypatch, capsys, "fit", "--config", TINY, "--config", str(tmp_path / "opt.yaml"))
    assert code == 2 and "optimizer is not an option of lightning-memrl" in err and "model.init_args.optimizer" in err


def test_help_lists_plot(monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, "--help")
    assert code == 0
    assert "{fit,validate,test,predict,plot,export}" in out and "PNG learning curves" in out
    assert "a checkpoint as a Hugging Face folder" in out
