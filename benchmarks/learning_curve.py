"""Learning benchmark: held-out accuracy of the base model, training, then accuracy again.

    python benchmarks/learning_curve.py --config configs/quickstart.yaml

Runs the real CLI three times in a scratch folder (``validate`` on the base model, ``fit``,
``validate --ckpt_path last.ckpt``), then writes under ``benchmarks/results/<config>/``: the two
evaluation reports, ``summary.json`` (exact match and F1 before/after, wall times, machine) and
the plots of ``lightning-memrl plot``. The validation tasks use the config's ``synthetic_val``
seed, which differs from the training seed.
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


def newest_report(root: Path) -> dict:
    path = max(root.glob("**/eval_report_step*.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml", help="config to train and evaluate")
    parser.add_argument("--max_steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    config = Path(args.config).resolve()
    out_dir = Path(__file__).parent / "results" / config.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="memrl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = ["--trainer.max_steps", str(args.max_steps)] if args.max_steps else []

    base_time = run(["validate", "--config", str(config)], work)
    base = newest_report(work)
    fit_time = run(["fit", "--config", str(config), *steps], work)
    ckpt = next(work.glob("**/checkpoints/last.ckpt"))
    trained_time = run(["validate", "--config", str(config), "--ckpt_path", str(ckpt)], work)
    trained = newest_report(work)

    (out_dir / "eval_base.json").write_text(json.dumps(base, indent=2) + "\n")
    (out_dir / "eval_trained.json").write_text(json.dumps(trained, indent=2) + "\n")
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
        "command": "python benchmarks/learning_curve.py --config "
        + str(Path(args.config))
        + (f" --max_steps {args.max_steps}" if args.max_steps else ""),
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
