"""``lightning-memrl plot``: per run folder, a warning before merging several runs, pandas reading and smoothing."""

from __future__ import annotations

import shutil
from pathlib import Path

from lightning_memrl import plot

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_METRICS = REPO / "benchmarks" / "results" / "quickstart" / "metrics.csv"  # a real 30-step run

# what the previous reader (the csv module) and smoothing (sums of list slices) gave for QUICKSTART_METRICS
EXPECTED_KEYS = 26
EXPECTED_REWARD_HEAD = [(0, 0.3333333432674408), (1, 0.3333333432674408), (2, 0.25)]
EXPECTED_REWARD_LAST = (29, 0.8333333134651184)
EXPECTED_VAL = [(14, 0.8229166865348816), (29, 0.8125)]
EXPECTED_SMOOTH = [  # train/reward, mean of 3
    0.3333333432674408, 0.3333333432674408, 0.3055555621782939, 0.4444444477558136, 0.5833333333333334,
    0.6388888855775198, 0.5277777711550394, 0.4722222089767456, 0.4999999900658925, 0.4999999900658925,
    0.5555555522441864, 0.6666666567325592, 0.8611111044883728, 0.8333333333333334, 0.8055555621782938,
    0.6666666666666666, 0.7222222089767456, 0.5833333233992258, 0.6666666567325592, 0.6666666567325592,
    0.8888888756434122, 0.9166666666666666, 0.8888888955116272, 0.6388888955116272, 0.6388888955116272,
    0.527777781089147, 0.7500000099341074, 0.6944444477558136, 0.8055555621782938, 0.7777777711550394,
]  # fmt: skip


def test_metrics_and_smoothing_are_the_numbers_of_the_csv_reader():
    """The numbers the previous ``csv``-module reader and list-comprehension smoothing gave for the same file."""
    series = plot.read_metrics([QUICKSTART_METRICS])
    assert len(series) == EXPECTED_KEYS
    reward = series["train/reward"]
    assert len(reward) == 30 and reward[:3] == EXPECTED_REWARD_HEAD and reward[-1] == EXPECTED_REWARD_LAST
    assert series["val/exact_match"] == EXPECTED_VAL
    values = [v for _, v in reward]
    assert plot.smooth(values, len(values) // 10) == EXPECTED_SMOOTH  # bit for bit
    assert plot.smooth([1.0, float("nan"), 3.0], 2) == [1.0, 1.0, 3.0]  # a NaN step does not blank the mean


def _run(folder: Path, source: Path = QUICKSTART_METRICS) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(source, folder / "metrics.csv")
    return folder


def test_a_folder_of_several_runs_is_merged_with_a_warning_naming_them(tmp_path, capsys):
    first, second = _run(tmp_path / "logs" / "csv" / "version_0"), _run(tmp_path / "logs" / "csv" / "version_1")
    (written,) = plot.main([str(tmp_path / "logs")])
    assert written == tmp_path / "logs" / "learning_curves.png" and written.read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err
    assert "logs holds the metrics.csv of 2 runs (csv/version_0, csv/version_1); merging" in err
    assert f"lightning-memrl plot {second}" in err  # the newest
    merged = plot.read_metrics(plot.metrics_files([first, second]))
    assert len(merged["train/reward"]) == 60  # both runs' points, by step
    assert plot.read_metrics(plot.metrics_files([second]))["train/reward"][0] == EXPECTED_REWARD_HEAD[0]
    assert capsys.readouterr().err == ""  # run folders named one by one: no warning
