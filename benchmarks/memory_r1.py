"""Memory-R1's two stages on LoCoMo, evaluated on a held-apart conversation: base, Memory-SFT, SFT + GRPO.

    python benchmarks/memory_r1.py --locomo PATH --train conv-26 conv-30 conv-41 conv-42 --held-apart conv-43

Every stage is one ``lightning-memrl fit`` (a subprocess; ``--in_process`` runs it in this process):

- ``sft``: ``configs/memory_r1/sft.yaml`` on the training conversations (extractor, manager and answer
  agent targets from LoCoMo's annotations); its LoRA adapter is the start of both GRPO stages.
- ``grpo_manager``: ``configs/memory_r1/locomo.yaml``, ``stage: manager``, training the ``sft`` adapter
  further (``lora.adapter_name_or_path``); the frozen extractor and answer agent are the ``sft`` adapter
  (``lora.frozen_adapter_name_or_path``). Its last checkpoint is exported (``lightning-memrl export``).
- ``grpo_answerer``: ``stage: answerer``, training the ``sft`` adapter further as the answer agent, with the
  ``grpo_manager`` adapter as the frozen extractor and manager; exported too.

With ``--kl_coef`` > 0 both GRPO stages add the KL term against the ``sft`` adapter
(``lora.reference_adapter_name_or_path``), not against the base model.

Each arm is evaluated by ``lightning-memrl validate`` with ``stage: answerer`` (the extractor and manager
generate with the frozen adapter, the answer agent with the policy's) on the held-apart conversation:

========================================  =====================  ===============
arm                                       extractor and manager  answer agent
========================================  =====================  ===============
base                                      the base model         the base model
sft                                       sft                    sft
sft+grpo_manager                          grpo_manager           sft
sft+grpo_manager+grpo_answerer            grpo_manager           grpo_answerer
========================================  =====================  ===============

The evaluation report gives exact match, F1, BLEU-1, evidence recall and the manager's valid-operation
rate, overall and by LoCoMo category. The caps (``--sft_steps``, ``--grpo_*_steps``, sessions and questions
per conversation, questions per step) are written with the results. Results: ``<out>/stages/<stage>.json``
(command, wall time, training metrics) and ``<out>/<arm>/result.json`` (with ``eval_report.json`` and
``predictions.jsonl``), each written as it finishes, then ``summary.json`` (with every arm against ``sft``
question by question: ``paired_vs_sft``); a stage or arm whose JSON exists is skipped, so an
interrupted run resumes (a stage trained again redoes the stages and arms built on it). Checkpoints and
adapters go under ``--work`` (not committed). Options the script does not know
(``--model.init_args.generation.max_new_tokens=16``) go to every GRPO fit and validate.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablation import _csv_mean, _newest_report, run_cli  # noqa: E402
from bench_utils import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SFT_CONFIG = ROOT / "configs" / "memory_r1" / "sft.yaml"
GRPO_CONFIG = ROOT / "configs" / "memory_r1" / "locomo.yaml"
OUT = Path(__file__).parent / "results" / "memory_r1"
STAGES = ["sft", "grpo_manager", "grpo_answerer"]
# arm -> (adapter of the extractor and manager, adapter of the answer agent); None: the base model
ARMS: dict[str, tuple[str | None, str | None]] = {
    "base": (None, None),
    "sft": ("sft", "sft"),
    "sft+grpo_manager": ("grpo_manager", "sft"),
    "sft+grpo_manager+grpo_answerer": ("grpo_manager", "grpo_answerer"),
}
NEEDS = {"sft": [], "grpo_manager": ["sft"], "grpo_answerer": ["sft", "grpo_manager"]}
METRICS = ("exact_match", "f1", "bleu1", "evidence_recall", "valid_operations")
P = "--model.init_args."
# --reward -> the reward functions of both GRPO stages (the evaluation reports EM and F1 either way)
REWARDS = {
    "exact_match": [{"class_path": "lightning_memrl.rewards.ExactMatch"}],
    "f1": [{"class_path": "lightning_memrl.rewards.TokenF1"}],
}


def add_split_options(p: argparse.ArgumentParser, arms: list[str], out: Path, work: Path) -> None:
    """The options a held-apart LoCoMo benchmark shares: data, split, caps, model, arms, folders."""
    p.add_argument("--locomo", required=True, help="LoCoMo JSON file or folder (with session_N_observation)")
    p.add_argument("--train", nargs="+", required=True, help="training conversation ids (development ones)")
    p.add_argument("--held-apart", required=True, help="the conversation every arm is evaluated on")
    p.add_argument("--arms", nargs="+", default=arms, choices=arms, help="arms to run (default: all)")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder or tiny")
    p.add_argument("--dtype", default="auto", help="model.init_args.dtype of every run")
    p.add_argument("--max_sessions", type=int, default=2, help="sessions read per training conversation (0: all)")
    p.add_argument("--max_questions", type=int, default=8, help="questions per training conversation (0: all)")
    p.add_argument("--val_sessions", type=int, default=None, help="sessions of the held-apart one (default: as train)")
    p.add_argument("--val_questions", type=int, default=None, help="its questions (default: as --max_questions)")
    p.add_argument("--seed", type=int, default=0, help="seed_everything of every run")
    p.add_argument("--out", type=Path, default=out, help="results folder")
    p.add_argument("--work", type=Path, default=work, help="checkpoints, adapters and logs")
    p.add_argument("--in_process", action="store_true", help="run the CLI in this process (quick checks)")


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_split_options(p, list(ARMS), OUT, Path("logs/bench_memory_r1"))
    p.add_argument("--sft_steps", type=int, default=50, help="SFT optimizer steps")
    p.add_argument("--sft_batch_size", type=int, default=4, help="SFT examples per step")
    p.add_argument("--sft_lr", type=float, default=1e-3, help="SFT learning rate (LoRA)")
    p.add_argument("--grpo_manager_steps", type=int, default=20, help="optimizer steps of the manager stage")
    p.add_argument("--grpo_answerer_steps", type=int, default=60, help="optimizer steps of the answerer stage")
    p.add_argument("--questions_per_step", type=int, default=1, help="GRPO questions per step (x group_size)")
    p.add_argument("--group_size", type=int, default=None, help="GRPO rollouts per question (default: the config's)")
    p.add_argument(
        "--kl_coef", type=float, default=0.0,
        help="grpo.kl_coef of both GRPO stages, taken against the SFT adapter (lora.reference_adapter_name_or_path)",
    )  # fmt: skip
    p.add_argument(
        "--reward", choices=list(REWARDS), default="exact_match",
        help="reward of both GRPO stages: exact_match (Memory-R1's) or f1 (token F1, partial credit)",
    )  # fmt: skip
    return p.parse_known_args(argv)


def _val_caps(args: argparse.Namespace) -> tuple[int, int]:
    """Sessions and questions read from the held-apart conversation."""
    sessions = args.max_sessions if args.val_sessions is None else args.val_sessions
    return sessions, args.max_questions if args.val_questions is None else args.val_questions


def _data_args(args: argparse.Namespace, prefix: str, conversations: list[str]) -> list[str]:
    """The LoCoMo caps of one split (``prefix``: ``locomo`` or ``locomo_val``) over ``conversations``."""
    d = f"--data.init_args.{prefix}."
    sessions, questions = _val_caps(args) if prefix == "locomo_val" else (args.max_sessions, args.max_questions)
    return [
        f"{d}conversations", json.dumps(conversations),
        f"{d}max_sessions", str(sessions or 100_000),  # 0: every session (a nested null reads as a string)
        f"{d}max_questions", str(questions or 100_000),
    ]  # fmt: skip


def _common(args: argparse.Namespace, config: Path, root: Path) -> list[str]:
    return [
        "--config", str(config),
        "--data.init_args.locomo_path", str(Path(args.locomo).resolve()),
        "--trainer.default_root_dir", str(root.resolve()),
        "--seed_everything", str(args.seed),
        f"{P}model_name_or_path", args.model,
        f"{P}dtype", args.dtype,
    ]  # fmt: skip


def _grpo_args(args: argparse.Namespace, root: Path, stage: str, start: Path | None, frozen: Path | None) -> list[str]:
    """A ``configs/memory_r1/locomo.yaml`` run: train on ``--train``, validate on ``--held-apart``."""
    out = [
        *_common(args, GRPO_CONFIG, root),
        *_data_args(args, "locomo", args.train),
        "--data.init_args.locomo_val_conversations", "0",
        *_data_args(args, "locomo_val", [args.held_apart]),
        "--data.init_args.batch_size", str(args.questions_per_step),
        "--data.init_args.val_batch_size", str(_val_caps(args)[1] or 100_000),  # 0: every question
        f"{P}workflow.init_args.stage", stage,
    ]  # fmt: skip
    for option, path in (("adapter_name_or_path", start), ("frozen_adapter_name_or_path", frozen)):
        if path is not None:
            out += [f"{P}lora.{option}", str(path)]
    return out


def stage_commands(args: argparse.Namespace, stage: str, extra: list[str]) -> list[list[str]]:
    """The CLI argument lists of ``stage``: its fit, then (GRPO) the export of its last checkpoint."""
    root = args.work / stage
    if stage == "sft":
        return [
            [
                "fit", *_common(args, SFT_CONFIG, root), *_data_args(args, "locomo", args.train),
                "--trainer.max_steps", str(args.sft_steps),
                "--data.init_args.batch_size", str(args.sft_batch_size),
                f"{P}optimizer.lr", str(args.sft_lr),
            ]
        ]  # fmt: skip
    sft, manager = adapter(args, "sft"), adapter(args, "grpo_manager")
    role, frozen = ("manager", sft) if stage == "grpo_manager" else ("answerer", manager)
    fit = [
        "fit", *_grpo_args(args, root, role, sft, frozen), *extra,
        f"{P}rewards", json.dumps(REWARDS[args.reward]),
        *([f"{P}grpo.group_size", str(args.group_size)] if args.group_size else []),
        *([f"{P}grpo.kl_coef", str(args.kl_coef), f"{P}lora.reference_adapter_name_or_path", str(sft)]
          if args.kl_coef > 0 else []),
        "--trainer.max_steps", str(args.grpo_manager_steps if role == "manager" else args.grpo_answerer_steps),
        "--trainer.limit_val_batches", "0",  # every arm is evaluated apart, by validate
    ]  # fmt: skip
    return [fit, ["export", str((root / "checkpoints" / "last.ckpt").resolve()), str(adapter(args, stage))]]


def adapter(args: argparse.Namespace, stage: str | None) -> Path | None:
    """Where ``stage`` leaves its LoRA adapter (None: the base model)."""
    return None if stage is None else (args.work / stage / "adapter").resolve()


def _run(command: list[str], cwd: Path, in_process: bool) -> float:
    """One CLI command (``export`` too); its wall time."""
    if command[0] == "export" and in_process:
        import time

        from lightning_memrl.export import main as export_main

        start = time.perf_counter()
        export_main(command[1:])
        return time.perf_counter() - start
    return run_cli(command, cwd, in_process)


def _shown(command: list[str], args: argparse.Namespace) -> str:
    """The command as a shell line: the data path as ``$LOCOMO``, paths under the repository or the working
    folder relative to it."""
    data, here, repo = str(Path(args.locomo).resolve()), str(Path.cwd()) + "/", str(ROOT) + "/"
    words = (shlex.quote(a).replace(data, "$LOCOMO").replace(repo, "").replace(here, "") for a in command)
    return "lightning-memrl " + " ".join(words)


def run_stage(args: argparse.Namespace, stage: str, extra: list[str]) -> dict[str, Any]:
    """Train ``stage`` (its fit, and for GRPO the export) and write ``<out>/stages/<stage>.json``."""
    root = args.work / stage
    if root.exists():  # a stage that did not finish starts again
        shutil.rmtree(root)
    root.mkdir(parents=True)
    commands = stage_commands(args, stage, extra)
    walls = [_run(command, root, args.in_process) for command in commands]
    metrics = max(root.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime, default=None)
    info = {
        "stage": stage,
        "commands": [_shown(c, args) for c in commands],
        "fit_wall_s": round(walls[0], 1),
        "adapter": str(args.work / stage / "adapter"),
        "train_loss": _csv_mean(metrics, "train/loss"),
        "train_reward": _csv_mean(metrics, "train/reward") if stage != "sft" else None,
        "train_manager_invalid_frac": _csv_mean(metrics, "train/manager/invalid_frac") if stage != "sft" else None,
        "step_time_s": _csv_mean(metrics, "time/step_s") if stage != "sft" else None,
    }
    path = args.out / "stages" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2) + "\n")  # last: marks the stage finished
    return info


def evaluate_arm(args: argparse.Namespace, arm: str, extra: list[str], stages: dict[str, dict]) -> dict[str, Any]:
    """Validate ``arm`` on the held-apart conversation; write ``<out>/<arm>/`` (result.json last)."""
    manager, answerer = ARMS[arm]
    root = args.work / "eval" / arm
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    command = [
        "validate",
        *_grpo_args(args, root, "answerer", adapter(args, answerer), adapter(args, manager)),
        *extra,
        "--trainer.limit_val_batches", "1",
    ]  # fmt: skip
    wall = _run(command, root, args.in_process)
    out = args.out / arm
    report = save_report(root, out)
    result = {
        "arm": arm,
        "extractor_and_manager": manager or "base model",
        "answer_agent": answerer or "base model",
        "held_apart": args.held_apart,
        **scores(report, METRICS),
        "stages": [stages[s] for s in _stages_of(arm)],
        "eval_command": _shown(command, args),
        "eval_wall_s": round(wall, 1),
        "caps": caps(args),
        "machine": run_machine(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")  # last: marks the arm finished
    return result


def _stages_of(arm: str) -> list[str]:
    """The stages an arm's adapters come from, in training order."""
    used = {s for s in ARMS[arm] if s}
    return [s for s in STAGES if s in used or any(s in NEEDS[u] for u in used)]


def save_report(root: Path, out: Path) -> dict[str, Any]:
    """Copy the newest evaluation report under ``root`` and its predictions to ``out``; the report."""
    report, predictions = _newest_report(root)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(predictions, out / "predictions.jsonl")
    (out / "eval_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def scores(report: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, Any]:
    """``overall`` and ``by_category`` of an evaluation report, each with its task count and ``metrics``."""
    keep = ("tasks", *metrics)
    by_category = {c: {k: row.get(k) for k in keep} for c, row in report["by_category"].items()}
    return {"overall": {k: report["overall"].get(k) for k in keep}, "by_category": by_category}


def run_machine() -> dict[str, Any]:
    """The machine facts of a result, with this process's torch threads and ``OMP_NUM_THREADS``."""
    import torch

    return {**machine(torch.get_num_threads()), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def write_summary(out: Path, results: dict[str, dict], metrics: tuple[str, ...], caps: dict[str, Any]) -> None:
    """``<out>/summary.json``: each arm's overall ``metrics`` and the caps; the table is printed too.

    Arms finished in ``out`` by earlier invocations are kept (after this invocation's); each arm's own
    ``result.json`` holds the caps it ran with.
    """
    earlier = {p.parent.name: json.loads(p.read_text()) for p in sorted(out.glob("*/result.json"))}
    results = {**results, **{arm: r for arm, r in earlier.items() if arm not in results}}
    table = {arm: {k: r["overall"][k] for k in metrics} for arm, r in results.items()}
    (out / "summary.json").write_text(json.dumps({"arms": table, "caps": caps}, indent=2) + "\n")
    print(json.dumps(table, indent=2))


def task_scores(out: Path, arm: str) -> dict[str, dict[str, float]]:
    """Exact match and token F1 (the evaluation's own) per held-apart question id of ``arm``'s predictions."""
    from lightning_memrl.rewards import token_f1

    rows = [json.loads(line) for line in (out / arm / "predictions.jsonl").read_text().splitlines() if line.strip()]
    return {
        "exact_match": {r["id"]: float(r["exact_match"]) for r in rows},
        "f1": {r["id"]: token_f1(r["answer"], r["answers"]) for r in rows},
    }


def write_paired(out: Path, reference: str = "sft") -> dict[str, Any]:
    """Every finished arm against ``reference`` question by question (EM and F1: mean difference, bootstrap
    interval over questions, sign test; ``lightning_memrl.evaluation.paired``), into ``summary.json``."""
    from lightning_memrl.evaluation.paired import paired_comparison

    finished = [p.parent.name for p in sorted(out.glob("*/result.json")) if (p.parent / "predictions.jsonl").is_file()]
    if reference not in finished:
        return {}
    ref = task_scores(out, reference)
    paired = {}
    for arm in (a for a in finished if a != reference):
        scores = task_scores(out, arm)
        paired[arm] = {m: paired_comparison(ref[m], scores[m]).to_dict() for m in ("exact_match", "f1")}
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps({**summary, f"paired_vs_{reference}": paired}, indent=2) + "\n")
    return paired


def data_caps(args: argparse.Namespace) -> dict[str, Any]:
    """The seed of every run, and the LoCoMo caps of the training conversations and of the held-apart one."""
    return {
        "seed": args.seed,
        "train_conversations": args.train,
        "sessions_per_conversation": args.max_sessions,
        "questions_per_conversation": args.max_questions,
        "held_apart_sessions": _val_caps(args)[0],
        "held_apart_questions": _val_caps(args)[1],
    }


def caps(args: argparse.Namespace) -> dict[str, Any]:
    """What was capped so that each stage fits its time budget."""
    return {
        **data_caps(args),
        "sft_steps": args.sft_steps,
        "sft_examples_per_step": args.sft_batch_size,
        "sft_lr": args.sft_lr,
        "grpo_manager_steps": args.grpo_manager_steps,
        "grpo_answerer_steps": args.grpo_answerer_steps,
        "grpo_questions_per_step": args.questions_per_step,
        "grpo_group_size": args.group_size or "configs/shared/locomo_grpo.yaml (2)",
        "grpo_reward": args.reward,
        "grpo_kl_coef": args.kl_coef,
        "grpo_kl_reference": "the sft adapter" if args.kl_coef > 0 else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args, extra = _args(argv)
    if args.held_apart in args.train:
        raise SystemExit(f"--held-apart {args.held_apart} is also in --train: keep it apart")
    stages: dict[str, dict] = {}
    fresh: set[str] = set()  # stages trained by this invocation: what was built on them is redone
    for stage in [s for s in STAGES if any(s in _stages_of(arm) for arm in args.arms)]:
        path = args.out / "stages" / f"{stage}.json"
        done = path.is_file() and (adapter(args, stage) / "adapter_config.json").is_file()
        if done and not fresh & set(NEEDS[stage]):
            print(f"stage {stage}: done before, skipped ({path})")
            stages[stage] = json.loads(path.read_text())
        else:
            stages[stage] = run_stage(args, stage, extra)
            fresh.add(stage)
    results = {}
    for arm in args.arms:
        path = args.out / arm / "result.json"
        if path.is_file() and not fresh & set(_stages_of(arm)):
            print(f"arm {arm}: done before, skipped ({path})")
            results[arm] = json.loads(path.read_text())
        else:
            results[arm] = evaluate_arm(args, arm, extra, stages)
    write_summary(args.out, results, METRICS, caps(args))
    write_paired(args.out)
    return results


if __name__ == "__main__":
    main()
