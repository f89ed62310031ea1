"""Learning benchmark: held-out accuracy of the base model, training, then accuracy again.

    python benchmarks/learning_curve.py --config configs/memagent/quickstart.yaml

Runs the real CLI three times in a scratch folder (``validate`` on the base model, ``fit``,
``validate --ckpt_path last.ckpt``), then writes under ``benchmarks/results/<config>/``: the two
evaluation reports and their per-task predictions, the training ``metrics.csv``, ``summary.json``
(exact match and F1 before/after, wall times, machine) and the plots of ``lightning-memrl plot``.
The validation tasks use the config's ``synthetic_val`` seed, which differs from the training seed.
Options the script does not know (``--model.optimizer.lr=2e-4``) go to ``validate`` and ``fit``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def run(args: list[str], cwd: Path) -> float:
    """Run the CLI; return its wall time. Output goes to the console."""
    exe = shutil.which("lightning-memrl") or str(Path(sys.executable).with_name("lightning-memrl"))
    start = time.perf_counter()
    subprocess.run([exe, *args], cwd=cwd, check=True)
    return time.perf_counter() - start


def newest_report(root: Path) -> tuple[dict, Path]:
    """The most recent evaluation report under ``root`` and its per-task predictions file."""
    path = max(root.glob("**/eval_report_step*.json"), key=lambda p: p.stat().st_mtime)
    report = json.loads(path.read_text())
    return report, path.parent / f"eval_predictions_step{report['step']}.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/quickstart.yaml", help="config to train and evaluate")
    parser.add_argument("--max_steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--val_tasks", type=int, default=None, help="override the number of held-out tasks")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args, overrides = parser.parse_known_args()  # the rest (e.g. --model.optimizer.lr=2e-4) goes to the CLI
    config = Path(args.config).resolve()
    out_dir = Path(__file__).parent / "results" / config.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="memrl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = ["--trainer.max_steps", str(args.max_steps)] if args.max_steps else []
    common = ["--config", str(config), *overrides]
    if args.val_tasks:
        common += ["--data.synthetic_val.num_tasks", str(args.val_tasks)]

    base_time = run(["validate", *common], work)
    base, base_predictions = newest_report(work)
    fit_time = run(["fit", *common, *steps], work)
    ckpt = next(work.glob("**/checkpoints/last.ckpt"))
    fit_metrics = max(work.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    trained_time = run(["validate", *common, "--ckpt_path", str(ckpt)], work)
    trained, trained_predictions = newest_report(work)

    (out_dir / "eval_base.json").write_text(json.dumps(base, indent=2) + "\n")
    (out_dir / "eval_trained.json").write_text(json.dumps(trained, indent=2) + "\n")
    shutil.copy(base_predictions, out_dir / "predictions_base.jsonl")  # per task: memories, answer, score
    shutil.copy(trained_predictions, out_dir / "predictions_trained.jsonl")
    shutil.copy(fit_metrics, out_dir / "metrics.csv")  # the training curves, for re-plotting
    run(
        [
            "plot",
            str(work),
            "--reports",
            str(out_dir / "eval_base.json"),
            str(out_dir / "eval_trained.json"),
            "--out",
            str(out_dir),
        ],
        work,
    )
    summary = {
        "config": str(Path(args.config)),
        "command": " ".join(
            ["python benchmarks/learning_curve.py --config", str(Path(args.config))]
            + ([f"--max_steps {args.max_steps}"] if args.max_steps else [])
            + ([f"--val_tasks {args.val_tasks}"] if args.val_tasks else [])
            + overrides
        ),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "trained_steps": trained["step"],
        "held_out_tasks": base["overall"]["tasks"],
        "base": base["overall"],
        "trained": trained["overall"],
        "exact_match_gain_points": 100 * (trained["overall"]["exact_match"] - base["overall"]["exact_match"]),
        "wall_s": {"validate_base": base_time, "fit": fit_time, "validate_trained": trained_time},
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
