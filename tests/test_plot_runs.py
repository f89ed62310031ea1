"""``lightning-memrl plot``: per run folder, a warning before merging several runs, pandas reading and smoothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lightning_memrl import plot

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_METRICS = REPO / "benchmarks" / "results" / "quickstart" / "metrics.csv"  # a real 30-step run


def test_metrics_and_smoothing_are_the_numbers_of_the_csv_reader(tmp_path):
    """The numbers the previous ``csv``-module reader and list-comprehension smoothing gave for the same file."""
    series = plot.read_metrics([QUICKSTART_METRICS])
    assert len(series) == EXPECTED_KEYS
    reward = series["train/reward"]
    assert len(reward) == 30 and reward[:3] == EXPECTED_REWARD_HEAD and reward[-1] == EXPECTED_REWARD_LAST
    assert series["val/exact_match"] == EXPECTED_VAL
    values = [v for _, v in reward]
    assert plot.smooth(values, len(values) // 10) == pytest.approx(EXPECTED_SMOOTH, rel=1e-12, abs=0)
    assert plot.smooth([1.0, float("nan"), 3.0], 2) == [1.0, 1.0, 3.0]  # a NaN step does not blank the mean


def _run(folder: Path, source: Path = QUICKSTART_METRICS) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(source, folder / "metrics.csv")
    return folder


def test_a_folder_of_several_runs_is_merged_with_a_warning_naming_them(tmp_path, capsys):
    first, second = _run(tmp_path / "logs" / "csv" / "version_0"), _run(tmp_path / "logs" / "csv" / "version_1")
    written = plot.main([str(tmp_path / "logs"), "--out", str(tmp_path / "png")])
    err = capsys.readouterr().err
    assert "logs holds the metrics.csv of 2 runs (csv/version_0, csv/version_1); merging" in err
    assert f"lightning-memrl plot {second}" in err  # the newest
    assert [p.name for p in written] == ["learning_curves.png"]
    merged = plot.read_metrics(plot.metrics_files([first, second]))
    assert len(merged["train/reward"]) == 60  # both runs' points, by step
    assert capsys.readouterr().err == ""  # runs named one by one: merged without a warning


def test_a_run_folder_is_plotted_into_itself(tmp_path, capsys):
    run = _run(tmp_path / "csv" / "version_0")
    (written,) = plot.main([str(run)])
    assert written == run / "learning_curves.png" and written.read_bytes()[:4] == b"\x89PNG"
    assert "warning" not in capsys.readouterr().err
