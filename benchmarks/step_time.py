"""Step-time breakdown of a config: runs ``lightning-memrl fit`` and reports per-phase medians.

    python benchmarks/step_time.py --config configs/memagent/tiny.yaml --steps 8

Writes ``benchmarks/results/step_time_<config>.json``. The first step (warm-up) is left out.
``update_s`` includes ``reference_s`` (the reference pass runs inside the update).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

KEYS = [
    "time/step_s",
    "time/rollout_s",
    "time/reference_s",
    "time/update_s",
    "time/rollout_tokens_per_s",
    "time/update_tokens_per_s",
    "train/turns_per_trajectory",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/tiny.yaml", help="config to time")
    parser.add_argument("--steps", type=int, default=8, help="training steps (first one is warm-up)")
    args = parser.parse_args()
    config = Path(args.config).resolve()
    exe = shutil.which("lightning-memrl") or str(Path(sys.executable).with_name("lightning-memrl"))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                exe,
                "fit",
                "--config",
                str(config),
                "--trainer.max_steps",
                str(args.steps),
                "--trainer.limit_val_batches",
                "0",
            ],
            cwd=tmp,
            check=True,
            capture_output=True,
        )
        metrics = next(Path(tmp).glob("**/metrics.csv"))
        rows = [r for r in csv.DictReader(open(metrics)) if r.get("time/step_s")][1:]
    result = {
        "config": str(Path(args.config)),
        "steps_measured": len(rows),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "median": {k: statistics.median(float(r[k]) for r in rows) for k in KEYS},
    }
    out = Path(__file__).parent / "results" / f"step_time_{config.stem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result["median"].items():
        print(f"{key:32s} {value:10.4g}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
