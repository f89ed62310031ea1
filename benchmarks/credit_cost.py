"""What each credit method adds to a step: ``time/*`` medians with and without it.

    python benchmarks/credit_cost.py --config configs/memagent/quickstart.yaml --steps 4 --threads 2

Runs ``lightning-memrl fit`` once on ``--config`` alone and once per overlay in ``examples/credit/``
(or those named with ``--only``, in that order), ``--steps`` steps each without validation, and reports the median
of every ``time/*`` metric over the steps after the first (warm-up), plus the method's own
``train/<method>/teacher_seconds`` where it logs one. With ``--steps 1`` it reports the first step
alone: every run starts from the same weights and seed, so that step rolls out the same tokens with
and without a method (``train/response_length`` and ``train/reward`` are recorded to show it) and
the difference is the method's own cost, not sampling noise. Each overlay is composed into
``--config`` as ``benchmarks/ablation.py`` composes its arms (the base config's rewards and callbacks
kept, the overlay's added), so a method is timed on the base run's rewards. Writes
``benchmarks/results/credit_cost_<config>.json`` and prints a markdown table. Run it alone on the
machine: other jobs change the timings.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench_utils as bu
import yaml
from ablation import TINY, _absolute_paths, compose_arm

REPO = Path(__file__).resolve().parents[1]
KEYS = ["time/step_s", "time/rollout_s", "time/reference_s", "time/update_s"]
# Recorded beside the timings: equal values across methods show the step rolled out the same tokens.
SAME_ROLLOUT_KEYS = ["train/response_length", "train/memory_length", "train/reward"]
# Rows whose advantage is exactly zero cost no update work (grpo.skip_zero_advantage): a method that
# changes advantages changes the update time this way, recorded to tell it from the method's own cost.
SKIP_KEYS = ["train/skipped_rows", "train/skipped_tokens"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/quickstart.yaml", help="base config to time")
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (the first is warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--only", nargs="*", default=None, help="overlay names (file stems) to run; default all")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in the results file and add these (its base run is kept beside this one's)",
    )
    return parser.parse_args(argv)


def overlays(only: list[str] | None) -> list[Path]:
    """The credit overlays to time, by file stem."""
    found = sorted((REPO / "examples" / "credit").glob("*.yaml"))
    if only is None:
        return found
    missing = sorted(set(only) - {p.stem for p in found})
    if missing:
        raise SystemExit(f"--only: no examples/credit/<name>.yaml for {missing}")
    by_stem = {p.stem: p for p in found}
    return [by_stem[name] for name in only]  # in the order given


def composed_config(config: Path, overlay: Path | None) -> tuple[dict[str, Any], list[str]]:
    """``overlay`` (written against the tiny config) composed into ``config``, and notes on what it left out."""
    base = _absolute_paths(yaml.safe_load(config.read_text()), config.parent)
    over = yaml.safe_load(overlay.read_text()) if overlay else None
    return compose_arm(base, over, yaml.safe_load(TINY.read_text()), str(overlay))


def run_fit(config: Path, overlay: Path | None, args: argparse.Namespace) -> dict[str, float]:
    """Medians of the ``time/*`` metrics (and any ``teacher_seconds``) of one ``fit`` after its warm-up step."""
    exe = shutil.which("lightning-memrl") or str(Path(sys.executable).with_name("lightning-memrl"))
    composed, notes = composed_config(config, overlay)
    for note in notes:
        print(note, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO / "examples")}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(composed, sort_keys=False))
        cmd = [exe, "fit", "--config", str(Path(tmp) / "config.yaml")]
        cmd += ["--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0"]
        cmd += ["--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false"]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:  # recorded, and the other methods still run
            sys.stderr.write(f"{overlay.name if overlay else config.name}: fit failed\n{proc.stderr[-3000:]}\n")
            return {"failed_exit_code": float(proc.returncode)}
        rows = [r for r in csv.DictReader(open(next(Path(tmp).glob("**/metrics.csv")))) if r.get("time/step_s")]
    rows = rows[1:] or rows
    keys = KEYS + SAME_ROLLOUT_KEYS + SKIP_KEYS + sorted({k for r in rows for k in r if k.endswith("/teacher_seconds")})
    return {k: bu.median([float(r[k]) for r in rows if r.get(k)]) for k in keys}


def earlier_result(path: Path, fresh: dict[str, Any]) -> dict[str, Any]:
    """The results in ``path`` extended by a new, empty session (each session keeps its machine and base run)."""
    old = json.loads(path.read_text())
    if old["config"] != fresh["config"] or old["steps"] != fresh["steps"]:
        raise SystemExit(f"--append: {path} holds --config {old['config']} --steps {old['steps']}; run the same")
    sessions = old.get("sessions") or [{"machine": old["machine"], "base": "(none)", "runs": list(old["runs"])[1:]}]
    base_name = f"(none) session {len(sessions) + 1}"
    return {**old, "sessions": [*sessions, {"machine": fresh["machine"], "base": base_name, "runs": []}]}


def cost_table(result: dict[str, Any]) -> list[list[Any]]:
    """One row per run; "step vs none" divides by the base run of the same session."""
    runs = result["runs"]
    base_of = {name: session["base"] for session in result["sessions"] for name in [session["base"], *session["runs"]]}
    return [
        [
            name,
            *(m.get(k, float("nan")) for k in KEYS),
            sum(v for k, v in m.items() if k.endswith("teacher_seconds")),
            m.get("train/skipped_rows", float("nan")),
            bu.ratio(m.get("time/step_s", float("nan")), runs[base_of[name]].get("time/step_s", float("nan"))),
        ]
        for name, m in runs.items()
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = (REPO / args.config).resolve() if not Path(args.config).is_absolute() else Path(args.config)
    machine = bu.machine(args.threads)
    result = {"config": args.config, "steps": args.steps, "machine": machine, "runs": {}}
    result["sessions"] = [{"machine": machine, "base": "(none)", "runs": []}]
    previous = bu.RESULTS / f"credit_cost_{config.stem}.json"
    if args.append and previous.exists():
        result = earlier_result(previous, result)
    session = result["sessions"][-1]
    session["overlays"] = "composed into the base config (its rewards and callbacks kept)"
    result["runs"][session["base"]] = run_fit(config, None, args)
    for overlay in overlays(args.only):
        result["runs"][overlay.stem] = run_fit(config, overlay, args)
        for earlier in result["sessions"][:-1]:  # a method measured again keeps only its newest run
            earlier["runs"] = [name for name in earlier["runs"] if name != overlay.stem]
        session["runs"].append(overlay.stem)
        bu.write_result(f"credit_cost_{config.stem}", result)  # after every run: a stopped run keeps what it measured
        print(f"{overlay.stem}: step {result['runs'][overlay.stem].get('time/step_s', float('nan')):.3f} s", flush=True)
    headers = [
        "method",
        "step s",
        "rollout s",
        "reference s",
        "update s",
        "teacher s",
        "rows skipped",
        "step vs its session's none",
    ]
    path = bu.write_result(f"credit_cost_{config.stem}", result)
    print(bu.markdown_table(headers, cost_table(result)))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
