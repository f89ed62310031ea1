"""``lightning-memrl plot RUN [RUN ...]``: PNG learning curves and a before/after evaluation chart."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# One panel each: the first metric of the panel that was logged is drawn (no KL without a reference).
CURVES = [
    [("train/reward", "reward (sampled)")],
    [("train/kl", "KL to reference"), ("train/entropy", "policy entropy (no KL term: kl_coef 0)")],
    [("train/response_length", "answer length (tokens)")],
    [("train/memory_length", "memory length (tokens)")],
]


def metrics_files(runs: list[Path]) -> list[Path]:
    """The ``metrics.csv`` of each run folder in ``runs`` (searched recursively), newest last.

    A folder that holds several runs' files (e.g. ``logs/tiny``, above ``csv/version_0``, ``csv/version_1``)
    gets a warning on stderr naming them, since their curves are merged by step.
    """
    files: list[Path] = []
    for run in runs:
        found = sorted(run.glob("**/metrics.csv"), key=lambda p: (p.stat().st_mtime, str(p)))
        if not found:
            raise FileNotFoundError(f"{run}: no metrics.csv below it; pass the folder a CSVLogger wrote to")
        if len(found) > 1:
            names = ", ".join(str(p.parent.relative_to(run)) for p in found)
            print(
                f"warning: {run} holds the metrics.csv of {len(found)} runs ({names}); merging their curves by step. "
                f"Plot one run with `lightning-memrl plot {found[-1].parent}` (the newest), or name the runs to merge.",
                file=sys.stderr,
            )
        files += found
    return files


def read_metrics(files: list[Path]) -> dict[str, list[tuple[int, float]]]:
    """The ``metrics.csv`` ``files`` merged into ``key -> [(step, value)]``, sorted; empty cells are skipped."""
    import pandas as pd

    series: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        if path.stat().st_size == 0:  # created, never written
            continue
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)  # "" is a metric not logged at that step
        for key in frame.columns:
            if key not in ("step", "epoch"):
                logged = frame[frame[key] != ""]
                series.setdefault(key, []).extend(zip(logged["step"].astype(int), logged[key].astype(float)))
    return {k: sorted((int(s), float(v)) for s, v in points) for k, points in series.items()}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean of the last ``window`` values (fewer at the start); NaN values are left out of the mean."""
    import pandas as pd

    return pd.Series(values, dtype=float).rolling(window, min_periods=1).mean().tolist()


def panel_metric(panel: list[tuple[str, str]], series: dict[str, list[tuple[int, float]]]) -> tuple[str, str]:
    """``(key, title)`` of the first metric of ``panel`` that was logged, else the panel's first."""
    return next(((key, title) for key, title in panel if series.get(key)), panel[0])


def evaluation_points(reports: list[dict]) -> list[tuple[int, float]]:
    """``(step, exact match)`` of each evaluation report, one per step (the last report wins).

    Reports carry the checkpoint's step, unlike the CSV of a ``validate`` run, which logs at step 0.
    """
    return sorted({int(r["step"]): float(r["overall"]["exact_match"]) for r in reports}.items())


def plot_learning_curves(
    series: dict[str, list[tuple[int, float]]], out: Path, evaluations: list[tuple[int, float]] | None = None
) -> Path:
    """A 2×2 figure of reward, KL (or entropy), answer and memory length against the optimizer step.

    ``evaluations`` (``(step, exact match)``) go on the reward panel; without them the CSV's
    ``val/exact_match`` is used.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, panel in zip(axes.flat, CURVES):
        key, title = panel_metric(panel, series)
        points = series.get(key, [])
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, color="tab:blue", alpha=0.35, label="per step")
            window = max(1, len(values) // 10)
            ax.plot(steps, smooth(list(values), window), color="tab:blue", label=f"mean of {window}")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"{key} not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
    evaluations = evaluations or series.get("val/exact_match")
    if evaluations:
        ax = axes.flat[0]
        steps, values = zip(*evaluations)
        ax.plot(steps, values, "o-", color="tab:green", label="val exact match (greedy)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_evaluation(reports: list[dict], labels: list[str], out: Path) -> Path:
    """Grouped bars of exact match and F1, overall and by number of chunks (or the report's ``unit``), per report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({k for r in reports for k in r["by_num_chunks"]}, key=int) + ["all"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(reports)
    for ax, metric in zip(axes, ("exact_match", "f1")):
        for i, (report, label) in enumerate(zip(reports, labels)):
            rows = {**report["by_num_chunks"], "all": report["overall"]}
            values = [100 * rows[g][metric] if g in rows else 0.0 for g in groups]
            bars = ax.bar([x + i * width for x in range(len(groups))], values, width, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks([x + width * (len(reports) - 1) / 2 for x in range(len(groups))], [f"{g}" for g in groups])
        ax.set_xlabel(f"{reports[0].get('unit', 'chunks')} in the context")  # LoCoMo: sessions
        ax.set_ylabel(f"{metric} (%)")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    """Write ``learning_curves.png`` and, when evaluation reports exist, ``evaluation.png``."""
    parser = argparse.ArgumentParser(prog="lightning-memrl plot", description=__doc__)
    parser.add_argument(
        "runs",
        type=Path,
        nargs="+",
        help="run folders (a logger's version_N) whose metrics.csv and eval_report*.json are plotted; several are "
        "merged by step (e.g. a run and its resumed continuation); so is a folder above several runs, with a warning",
    )
    parser.add_argument(
        "--reports",
        type=Path,
        nargs="*",
        default=None,
        help="eval_report*.json files to compare (default: the first and last found in the runs)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the first run folder)")
    args = parser.parse_args(argv)
    out_dir = args.out or args.runs[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(
        {p for run in args.runs for p in run.glob("**/eval_report*.json")}, key=lambda p: (p.stat().st_mtime, str(p))
    )
    evaluations = evaluation_points([json.loads(p.read_text()) for p in found])
    series = read_metrics(metrics_files(args.runs))
    written = [plot_learning_curves(series, out_dir / "learning_curves.png", evaluations)]
    report_files = args.reports
    if report_files is None:
        found = sorted(found, key=lambda p: json.loads(p.read_text())["step"])
        report_files = [found[0], found[-1]] if len(found) > 1 else found
    if report_files:
        reports = [json.loads(p.read_text()) for p in report_files]
        labels = [f"step {r['step']}" for r in reports]
        written.append(plot_evaluation(reports, labels, out_dir / "evaluation.png"))
    for path in written:
        print(f"wrote {path}")
    return written
