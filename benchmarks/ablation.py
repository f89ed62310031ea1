"""Ablation: the base model, plain GRPO and each credit method of ``examples/credit/``, side by side.

    python benchmarks/ablation.py --config configs/memagent/multichunk.yaml --seeds 0 1 --threads 2

Every arm trains with the same config, steps, tasks, learning rate and seed (``--seeds``: one run per
seed); ``base`` only validates the untrained model. An arm's config is the base config with the credit
overlay composed in by this script: the overlays are written against ``configs/memagent/tiny.yaml``, and
a callbacks or rewards list in an overlay replaces the whole list, so entries that only repeat the tiny
config's are left out and the base config's own callbacks and rewards are kept (a base entry the overlay
drops on purpose, e.g. ``MemoryTokenCredit`` next to another memory credit, is dropped and said so); any
other list in an overlay stops the run. The composed config is saved next to each arm's results.

Each finished run writes ``benchmarks/results/ablation/<arm>_seed<k>/``: ``result.json`` (held-out exact
match overall, by number of chunks, by the position of the chunk that held the answer, by hops; mean memory
length; step time), ``eval_report.json``, ``predictions.jsonl`` (per task: the memory after every chunk,
the answer, its score), ``metrics.csv`` and ``config.yaml``. A run whose ``result.json`` exists is skipped,
and a run interrupted mid-training resumes from its last step: runs train in ``--work/<arm>_seed<k>``
(default ``logs/ablation``), saving ``last.ckpt`` after every step, until they finish. Then
``ablation_report`` summarises every finished run in the results folder (earlier invocations' too):
``summary.json`` (with each arm's ``paired`` difference from ``base`` and ``grpo`` on the same seeds and
tasks), ``summary.md``, ``ablation_em.png``, ``retention.png`` and ``paired.png``. Options the script does
not know (``--model.optimizer.lr=2e-4``) go to every run.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_utils as bu
import torch
import yaml
from ablation_report import SECTIONS, finished_runs, summarise

ROOT = Path(__file__).resolve().parent.parent
CREDIT = ROOT / "examples" / "credit"
TINY = ROOT / "configs" / "memagent" / "tiny.yaml"
OUT = Path(__file__).parent / "results" / "ablation"
CREDIT_ARMS = [
    "state_progress",
    "himpo_memory_credit",
    "tips",
    "info_gain",
    "fine_mem",
    "local_rerollouts",
    "turn_level_advantage",
    "dynamic_sampling",
    "stack_of_three",
]
ARMS = ["base", "grpo", *CREDIT_ARMS]
LISTS = (("trainer", "callbacks"), ("model", "init_args", "rewards"))  # the lists an overlay may set
CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".parquet")


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _merge(base: Any, over: Any, where: str, source: str) -> Any:
    """``over`` on top of ``base``: dicts key by key (a new ``class_path`` replaces the whole entry)."""
    if isinstance(base, dict) and isinstance(over, dict):
        if "class_path" in over and over["class_path"] != base.get("class_path"):
            return copy.deepcopy(over)
        out = copy.deepcopy(base)
        for key, value in over.items():
            out[key] = _merge(base.get(key), value, f"{where}.{key}" if where else key, source)
        return out
    if isinstance(over, list):
        raise SystemExit(
            f"{source}: sets the list {where}, which replaces the base config's list; only "
            f"{', '.join('.'.join(p) for p in LISTS)} are composed. Set it in the base config."
        )
    return copy.deepcopy(over)


def _compose_list(base: list, over: list, tiny: list, source: str, where: str, notes: list[str]) -> list:
    """The base list with the overlay's new entries; entries that only repeat the tiny config's are left out."""
    tiny_cps = {e["class_path"] for e in tiny}
    over_by_cp = {e["class_path"]: e for e in over}
    out = []
    for entry in base:
        cp = entry["class_path"]
        if cp in over_by_cp and cp not in tiny_cps:
            out.append(copy.deepcopy(over_by_cp[cp]))  # the overlay's own settings of a base entry
        elif cp in tiny_cps and cp not in over_by_cp and cp != CHECKPOINT:
            notes.append(f"{source}: leaves {cp} out of {where}, so the arm runs without it")
        else:
            out.append(copy.deepcopy(entry))
    base_cps = {e["class_path"] for e in base}
    for entry in over:
        cp = entry["class_path"]
        if cp in tiny_cps and cp not in base_cps:
            notes.append(f"{source}: {cp} in {where} repeats the tiny config; not added")
        elif cp not in base_cps:
            out.append(copy.deepcopy(entry))
    return out


def compose_arm(base: dict, overlay: dict | None, tiny: dict, source: str) -> tuple[dict, list[str]]:
    """An arm's config: ``overlay`` (written against ``tiny``) applied to ``base``, plus notes on what it dropped."""
    if not overlay:
        return copy.deepcopy(base), []
    notes: list[str] = []
    rest = copy.deepcopy(overlay)
    lists = {}
    for path in LISTS:
        parent = _get(rest, path[:-1])
        if isinstance(parent, dict) and path[-1] in parent:
            lists[path] = parent.pop(path[-1])
    config = _merge(base, rest, "", source)
    for path, over in lists.items():
        where = ".".join(path)
        composed = _compose_list(_get(base, path) or [], over, _get(tiny, path) or [], source, where, notes)
        missing = {e["class_path"] for e in _get(base, path) or []} - {e["class_path"] for e in composed}
        if path[-1] == "rewards" and missing - {e["class_path"] for e in _get(tiny, path) or []}:
            raise SystemExit(f"{source}: the composed {where} lost the base config's {sorted(missing)}")
        _get(config, path[:-1])[path[-1]] = composed
    pattern = _get(base, ("model", "init_args", "answer_pattern"))
    for path in lists:
        for entry in _get(config, path):
            init = entry.get("init_args") or {}
            if pattern and "answer_pattern" in init and init["answer_pattern"] is None:  # tiny: a boxed answer
                init["answer_pattern"] = pattern
                notes.append(f"{source}: {entry['class_path']} scores answers with the base answer_pattern {pattern!r}")
    return config, notes


def run_cli(args: list[str], cwd: Path, in_process: bool = False) -> float:
    """Run the CLI (``examples/`` importable for the overlays' classes); return its wall time.

    ``in_process`` runs it in this process (no interpreter start-up: the quick check of the script);
    the default, a subprocess per run, keeps every arm's memory and threads apart.
    """
    if in_process:
        from lightning_memrl.cli import build_cli

        start, here = time.perf_counter(), Path.cwd()
        if str(ROOT / "examples") not in sys.path:
            sys.path.insert(0, str(ROOT / "examples"))
        os.chdir(cwd)
        try:
            build_cli(args)
        finally:
            os.chdir(here)
        return time.perf_counter() - start
    exe = shutil.which("lightning-memrl") or str(Path(sys.executable).with_name("lightning-memrl"))
    paths = [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    start = time.perf_counter()
    run = subprocess.Popen([exe, *args], cwd=cwd, env=env)
    # SIGTERM to this script reaches the run, which finishes its step and saves last.ckpt before exiting
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: run.send_signal(signal.SIGTERM))
    try:
        code = run.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code:
        raise subprocess.CalledProcessError(code, run.args)
    return time.perf_counter() - start


def _newest_report(root: Path) -> tuple[dict, Path]:
    path = max(root.glob("**/eval_report_step*.json"), key=lambda p: json.loads(p.read_text())["step"])
    report = json.loads(path.read_text())
    return report, path.parent / f"eval_predictions_step{report['step']}.jsonl"


def _csv_mean(path: Path | None, column: str) -> float | None:
    if path is None:
        return None
    with path.open() as f:
        values = [float(row[column]) for row in csv.DictReader(f) if row.get(column) not in (None, "")]
    return statistics.fmean(values) if values else None


def checkpoint_every_step(config: dict) -> dict:
    """``config`` with every ``ModelCheckpoint`` saving ``last.ckpt`` after each optimizer step.

    A LoRA checkpoint holds the adapters and their optimizer state only, so this costs little, and an
    interrupted arm resumes from its last step (the checkpoint restores weights, optimizer, data
    position and RNG states: the resumed run trains as an uninterrupted one would).
    """
    config = copy.deepcopy(config)
    for entry in _get(config, ("trainer", "callbacks")) or []:
        if entry.get("class_path") == CHECKPOINT:
            entry.setdefault("init_args", {}).update(save_last=True, every_n_train_steps=1)
    return config


def prepare_work(work: Path, run: dict) -> Path | None:
    """Make ``work`` the folder of ``run`` (its config, seed and options); the checkpoint to resume, if any.

    A folder left by an interrupted invocation of the same run keeps its checkpoints and logs; one of
    another run (a changed config, seed or option) is emptied, since resuming it would mix two runs.
    """
    record = work / "run.json"
    if work.is_dir() and (not record.is_file() or json.loads(record.read_text()) != run):
        print(f"{work}: left by a different run; starting afresh")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(run, indent=1) + "\n")
    last = sorted(work.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
    return last[-1] if last else None


def merge_metrics(work: Path, dest: Path) -> Path | None:
    """The ``metrics.csv`` of every invocation of a run as one file: a step redone after a resume counts once.

    An invocation that resumed from step N logs from step N on; the rows an earlier, interrupted one
    logged for those steps are replaced by the resumed run's.
    """
    parts = []
    for path in sorted(work.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        steps = [int(row["step"]) for row in rows if row.get("step") not in (None, "")]
        parts.append((min(steps, default=0), rows))
    if not parts:
        return None
    merged = []
    for i, (_, rows) in enumerate(parts):
        until = parts[i + 1][0] if i + 1 < len(parts) else None
        merged += [r for r in rows if until is None or r.get("step") in (None, "") or int(r["step"]) < until]
    fields = list(dict.fromkeys(key for _, rows in parts for row in rows for key in row))
    with dest.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(merged)
    return dest


def run_arm(
    arm: str, seed: int, config: dict, steps: int | None, extra: list[str], out: Path, in_process: bool, work: Path
) -> dict:
    """Train (unless ``base``) and validate one arm in ``work``; write its files under ``out``; return its result.

    ``work`` outlives an interrupted invocation: the next one resumes from its ``last.ckpt``.
    """
    out.mkdir(parents=True, exist_ok=True)
    machine = bu.machine(int(os.environ.get("OMP_NUM_THREADS", "0")))  # 0: the CLI picks its threads; code at start
    config = checkpoint_every_step(config)
    (out / "config.yaml").write_text(yaml.safe_dump(_repo_relative_paths(config), sort_keys=False))
    n = None if arm == "base" else steps or config["trainer"]["max_steps"]
    resume = prepare_work(work, {"config": config, "seed": seed, "extra": extra})  # more steps: trains on
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))  # the run's copy: absolute paths
    common = ["--config", str(work / "config.yaml"), "--seed_everything", str(seed), *extra]
    resumed_from = None
    if n is None:
        wall = run_cli(["validate", *common], work, in_process)
    else:
        steps_args = ["--trainer.max_steps", str(n), "--trainer.val_check_interval", str(n)]
        if resume is not None:
            resumed_from = int(torch.load(resume, map_location="cpu", weights_only=False)["global_step"])
            print(f"{arm} seed {seed}: resuming from step {resumed_from} ({resume})")
            steps_args += ["--ckpt_path", str(resume)]
        wall = run_cli(["fit", *common, *steps_args], work, in_process)
    report, predictions = _newest_report(work)
    metrics = merge_metrics(work, work / "metrics_merged.csv")
    rows = [json.loads(line) for line in predictions.read_text().splitlines() if line.strip()]
    memories = [len(m.split()) for row in rows for m in row["memories"]]
    shutil.copy(predictions, out / "predictions.jsonl")
    if metrics is not None and arm != "base":
        shutil.copy(metrics, out / "metrics.csv")
    (out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n")
    result = {
        "arm": arm,
        "seed": seed,
        "steps": report["step"],
        "overall": report["overall"],
        **{k: report[k] for k in SECTIONS if k in report},
        "eval_memory_words": statistics.fmean(memories) if memories else 0.0,
        "train_memory_tokens": _csv_mean(metrics if arm != "base" else None, "train/memory_length"),
        "step_time_s": _csv_mean(metrics if arm != "base" else None, "time/step_s"),
        "wall_s": wall,  # this invocation's; a resumed run's earlier invocations are in step_time_s only
        "resumed_from_step": resumed_from,
        "machine": machine,
    }
    shutil.rmtree(work, ignore_errors=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")  # last: marks the run finished
    return result


def _absolute_paths(tree: Any, folder: Path) -> Any:
    """File options (``lora: ../shared/x.yaml``) made absolute: the composed config is saved elsewhere."""
    if isinstance(tree, dict):
        return {k: _absolute_paths(v, folder) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_absolute_paths(v, folder) for v in tree]
    if isinstance(tree, str) and tree.endswith(FILE_SUFFIXES) and not Path(tree).is_absolute():
        if (folder / tree).is_file():
            return str((folder / tree).resolve())
    return tree


def _repo_relative_paths(tree: Any) -> Any:
    """The absolute file options of :func:`_absolute_paths` under the repository, relative to its root again:
    the config saved with the results names files as the repository does, not as this machine does."""
    if isinstance(tree, dict):
        return {k: _repo_relative_paths(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_repo_relative_paths(v) for v in tree]
    if isinstance(tree, str) and Path(tree).is_absolute() and Path(tree).is_relative_to(ROOT):
        return str(Path(tree).relative_to(ROOT))
    return tree


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/multichunk.yaml", help="the base config of every arm")
    parser.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS, help="arms to run (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="seed_everything of each run")
    parser.add_argument("--max_steps", type=int, default=None, help="training steps of every arm (default: config's)")
    parser.add_argument("--val_tasks", type=int, default=None, help="override the number of held-out tasks")
    parser.add_argument("--out", type=Path, default=OUT, help="results folder")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of each run (OMP_NUM_THREADS; default: the CLI picks)"
    )
    parser.add_argument(
        "--work", type=Path, default=ROOT / "logs" / "ablation", help="runs' checkpoints and logs until they finish"
    )
    parser.add_argument("--in_process", action="store_true", help="run the CLI in this process (quick checks)")
    args, extra = parser.parse_known_args(argv)  # the rest (e.g. --model.optimizer.lr=2e-4) goes to every run
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by each run's torch at start; recorded in result.json
    base = _absolute_paths(yaml.safe_load(Path(args.config).read_text()), Path(args.config).resolve().parent)
    tiny = yaml.safe_load(TINY.read_text())
    if args.val_tasks:
        extra = [*extra, "--data.synthetic_val.num_tasks", str(args.val_tasks)]
    configs = {}
    for arm in args.arms:  # compose every arm first: a bad overlay stops before any training
        overlay = yaml.safe_load((CREDIT / f"{arm}.yaml").read_text()) if arm in CREDIT_ARMS else None
        configs[arm], notes = compose_arm(base, overlay, tiny, f"examples/credit/{arm}.yaml")
        for note in notes:
            print(note)
    for arm in args.arms:
        for seed in args.seeds:
            out = args.out / f"{arm}_seed{seed}"
            if (out / "result.json").is_file():
                print(f"{arm} seed {seed}: done before, skipped ({out / 'result.json'})")
            else:
                work = args.work / f"{arm}_seed{seed}"
                try:
                    run_arm(arm, seed, configs[arm], args.max_steps, extra, out, args.in_process, work)
                except subprocess.CalledProcessError as error:  # e.g. SIGTERM: the run saved last.ckpt first
                    raise SystemExit(
                        f"{arm} seed {seed}: the run stopped (exit code {error.returncode}); its checkpoints stay in "
                        f"{work}, and the same command resumes it from its last step"
                    ) from None
    summary = summarise(finished_runs(args.out, ARMS), args.out)
    print(json.dumps({a: round(100 * s["exact_match"], 1) for a, s in summary["arms"].items()}, indent=2))
    return summary


if __name__ == "__main__":
    main()
