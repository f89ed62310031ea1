"""Step-time breakdown of a config: runs ``lightning-memrl fit`` and reports per-phase medians.

    python benchmarks/step_time.py --config configs/memagent/tiny.yaml --steps 8 [--threads 2] [--tag T] [FIT OPTIONS]

Writes ``benchmarks/results/step_time_<config>[_<tag>].json`` with the machine (CPU, ISA flags, threads)
and the command. The first step (warm-up) is left out. ``update_s`` includes ``reference_s`` (the
reference pass runs inside the update). Options the script does not know go to ``fit``
(``--model.init_args.dtype=float32``). Without ``--threads`` the CLI picks its own thread count.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu  # noqa: E402

KEYS = [
    "time/step_s",
    "time/rollout_s",
    "time/reference_s",
    "time/update_s",
    "time/rollout_tokens_per_s",
    "time/update_tokens_per_s",
    "train/turns_per_trajectory",
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/tiny.yaml", help="config to time")
    parser.add_argument("--steps", type=int, default=8, help="training steps (first one is warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads of the run (0: the CLI's choice)")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. the machine kind)")
    args, fit_options = parser.parse_known_args(argv)
    config = Path(args.config).resolve()
    exe = shutil.which("lightning-memrl") or str(Path(sys.executable).with_name("lightning-memrl"))
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    cmd = [exe, "fit", "--config", str(config), "--trainer.max_steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*cmd, "--trainer.limit_val_batches", "0", *fit_options], cwd=tmp, env=env, check=True)
        metrics = next(Path(tmp).glob("**/metrics.csv"))
        rows = [r for r in csv.DictReader(open(metrics)) if r.get("time/step_s")][1:]
    result = {
        "command": " ".join(["python benchmarks/step_time.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": str(Path(args.config)),
        "steps_measured": len(rows),
        "machine": bu.machine(args.threads, cli=True),  # threads 0: the CLI picked its own count
        "median": {k: statistics.median(float(r[k]) for r in rows) for k in KEYS if rows and _logged_by_all(rows, k)},
    }
    out = bu.write_result(bu.tagged(f"step_time_{config.stem}", args.tag), result)
    for key, value in result["median"].items():
        print(f"{key:32s} {value:10.4g}")
    print(f"wrote {out}")
    return result


def _logged_by_all(rows: list[dict[str, str]], key: str) -> bool:
    """Whether every measured row logged ``key``."""
    return all(r.get(key) for r in rows)


if __name__ == "__main__":
    main()
