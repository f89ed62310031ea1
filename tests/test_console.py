"""What a run shows: the console of a real tiny fit, the package's INFO lines, and what TensorBoard receives."""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from locomo_fixture import write_locomo

from lightning_memrl.console import BNB_LOGGER, show_info_logs
from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.errors import ConfigError
from lightning_memrl.evaluation.report import evaluation_report, format_report
from lightning_memrl.evaluation.tables import due, markdown_table, report_scalars
from lightning_memrl.settings import GRPOSettings

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "memagent" / "tiny.yaml")
SHOWN = 8  # num_completions_to_print of the run below: every trajectory of its step (2 tasks x group of 4)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    """One LoRA step of configs/memagent/tiny.yaml, validated after it, with log_completions; (logs, console)."""
    cwd = tmp_path_factory.mktemp("console")
    args = ["fit", "--config", TINY, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1"]
    args += ["--trainer.num_sanity_val_steps", "0", "--model.init_args.lora", "{r: 2, alpha: 4}"]
    args += ["--model.init_args.grpo.log_completions", "true"]
    args += ["--model.init_args.grpo.num_completions_to_print", str(SHOWN)]
    exe = Path(sys.executable).with_name("lightning-memrl")
    env = {**os.environ, "COLUMNS": "400"}  # the progress bar on one line
    proc = subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return cwd / "logs" / "tiny", proc.stdout + proc.stderr


def test_console_of_a_fit_shows_steps_metrics_and_info_lines_without_noise(run):
    _, console = run
    assert console.count("tasks: 32 train, 8 validation") == 1  # our INFO line, once
    bar = next(line for line in console.splitlines() if line.lstrip().startswith("Steps"))
    assert "1/1" in bar  # optimizer steps out of max_steps
    for metric in ("reward:", "loss:", "kl:", "step_s:"):
        assert metric in bar, (metric, bar)
    assert "Epoch 0/-2" not in console
    assert "Using ModelCheckpoint with manual optimization" not in console  # 13 lines with sample code
    assert "Failed to load CPU gemm_4bit_forward" not in console


def _events(logs: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = (logs / "tb").glob("version_*")
    return EventAccumulator(str(version)).Reload()


def _text(events, tag: str) -> str:
    (event,) = events.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def test_tensorboard_gets_evaluation_tables_bleu1_and_sample_completions(run):
    logs, _ = run
    events = _events(logs)
    scalars = set(events.Tags()["scalars"])
    assert "val/bleu1" in scalars and "val/exact_match" in scalars
    buckets = {tag for tag in scalars if tag.startswith("val_by_chunks/")}
    assert buckets and buckets <= {f"val_by_chunks/{n}/{m}" for n in (2, 3) for m in ("exact_match", "f1", "bleu1")}
    report = _text(events, "evaluation/report")
    assert "Evaluation at step 1" in report and "chunks" in report and "bleu1" in report
    header, _, *rows = _text(events, "completions").splitlines()
    assert header == "| task | prompt (tail) | completion | reward | advantage |"
    assert len(rows) == SHOWN
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows]
    rewards, advantages = [float(c[-2]) for c in cells], [float(c[-1]) for c in cells]
    metrics = csv.DictReader(open(next((logs / "csv").glob("version_*/metrics.csv"))))
    (train_row,) = [r for r in metrics if r["train/reward"]]
    assert sum(rewards) / SHOWN == pytest.approx(float(train_row["train/reward"]), abs=1e-3)  # the whole step's mean
    for group in range(2):  # GRPO advantages are centred within each group of 4
        assert sum(advantages[4 * group : 4 * group + 4]) == pytest.approx(0.0, abs=1e-2)


def test_val_bleu1_is_a_logged_metric(run):
    logs, _ = run
    rows = list(csv.DictReader(open(next((logs / "csv").glob("version_*/metrics.csv")))))
    (value,) = [float(r["val/bleu1"]) for r in rows if r.get("val/bleu1")]
    assert 0.0 <= value <= 1.0 and not math.isnan(value)


def test_locomo_reports_count_sessions(tmp_path):
    tasks = load_locomo(write_locomo(tmp_path))
    assert {t.meta["context_unit"] for t in tasks} == {"sessions"}
    records = [(3, 1.0, 1.0, {"category": 4}), (2, 0.0, 0.5, {"category": 1})]
    report = evaluation_report(records, step=2, unit="sessions")
    assert format_report(report).splitlines()[1].split()[0] == "sessions"
    assert report_scalars(report) == {
        "val_by_sessions/2/exact_match": 0.0,
        "val_by_sessions/2/f1": 0.5,
        "val_by_sessions/3/exact_match": 1.0,
        "val_by_sessions/3/f1": 1.0,
        "val_by_category/1/exact_match": 0.0,
        "val_by_category/1/f1": 0.5,
        "val_by_category/4/exact_match": 1.0,
        "val_by_category/4/f1": 1.0,
    }


def test_a_completion_stays_in_its_table_row():
    table = markdown_table([{"completion": "a|b\nc\u2028d\x0be\x16f", "reward": 0.25}])
    assert table.splitlines() == ["| completion | reward |", "|---|---|", "| a\\|b ↵ c ↵ d ↵ e f | 0.250 |"]


def test_completions_are_due_every_log_every_n_steps_and_their_count_is_checked():
    assert [s for s in range(1, 9) if due(s, 1, 3)] == [3, 6]
    assert [s for s in range(2, 13, 2) if due(s, 2, 3)] == [4, 6, 10, 12]  # ppo_epochs 2: steps 2, 4, ...
    with pytest.raises(ConfigError, match="num_completions_to_print"):
        GRPOSettings(num_completions_to_print=0)


@contextmanager
def bare_logging() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    """No handler on the root logger (pytest's own taken off too) and a fresh ``lightning_memrl`` logger, as in a
    new process; everything restored after."""
    root, package = logging.getLogger(), logging.getLogger("lightning_memrl")
    saved = (root.handlers[:], root.level, package.handlers[:], package.filters[:], package.level)
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    package.handlers.clear()
    package.filters.clear()
    package.setLevel(logging.NOTSET)
    try:
        yield root, package
    finally:
        root.handlers[:], package.handlers[:], package.filters[:] = saved[0], saved[2], saved[3]
        root.setLevel(saved[1])
        package.setLevel(saved[4])


def test_info_lines_print_once_until_logging_is_configured(capsys):
    log = logging.getLogger("lightning_memrl.data.datamodule")
    with bare_logging() as (root, _):
        show_info_logs()
        show_info_logs()  # idempotent: still one line per record
        log.info("tasks: 3 train")
        assert capsys.readouterr().err == "tasks: 3 train\n"
        user = io.StringIO()
        root.addHandler(logging.StreamHandler(user))  # the user configures logging later: their handler prints
        log.warning("seen once")
        assert capsys.readouterr().err == ""
        assert user.getvalue() == "seen once\n"


def test_a_logging_config_made_first_is_left_alone():
    with bare_logging() as (root, package):
        root.addHandler(logging.NullHandler())
        show_info_logs()
        assert package.handlers == [] and package.level == logging.NOTSET and package.filters == []


def test_bitsandbytes_cpu_kernel_line_is_dropped_and_other_lines_kept(caplog):
    bnb = logging.getLogger(BNB_LOGGER)
    with caplog.at_level(logging.WARNING, logger=BNB_LOGGER):
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
        bnb.warning("another bitsandbytes line")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes line"]
