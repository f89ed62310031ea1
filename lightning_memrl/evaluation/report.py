"""What a run reports: the evaluation report (overall, by chunks, by category), its files, and step metrics."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_memrl import distributed
from lightning_memrl.evaluation.metrics import bleu1
from lightning_memrl.evaluation.tables import log_evaluation_report
from lightning_memrl.rewards import answer_from_completion, exact_match, token_f1
from lightning_memrl.types import RolloutBatch, Trajectory

# extras that group tasks rather than being averaged: the key in the extras -> the section of the report
GROUPINGS = {"category": "by_category", "answer_position": "by_answer_position", "hops": "by_hops"}


def evaluation_report(records: list[tuple], **info: Any) -> dict[str, Any]:
    """Exact match, F1 and extra metrics overall, by number of chunks and (when tasks have them) by the groupings.

    A record is ``(chunks, em, f1)`` or ``(chunks, em, f1, extras)``; ``extras`` maps metric names to
    numbers (None: not measured for that task, left out of its mean) and may hold the grouping keys of
    :data:`GROUPINGS`: ``category``, ``answer_position`` (1 = the first chunk held the answer: the retention
    curve) and ``hops``; each present one adds its section (``by_category``, ``by_answer_position``, ``by_hops``).
    """

    def extras(r: tuple) -> dict[str, Any]:
        return r[3] if len(r) > 3 else {}

    names = list(dict.fromkeys(k for r in records for k in extras(r) if k not in GROUPINGS))

    def summary(rows: list[tuple]) -> dict[str, float]:
        out = {
            "tasks": len(rows),
            "exact_match": sum(r[1] for r in rows) / len(rows),
            "f1": sum(r[2] for r in rows) / len(rows),
        }
        for name in names:
            values = [extras(r)[name] for r in rows if extras(r).get(name) is not None]
            if values:
                out[name] = sum(values) / len(values)
        return out

    by_chunks = {str(n): summary([r for r in records if r[0] == n]) for n in sorted({r[0] for r in records})}
    report = {**info, "overall": summary(records), "by_num_chunks": by_chunks}
    for key, section in GROUPINGS.items():
        values = sorted({extras(r).get(key) for r in records} - {None}, key=lambda v: (str(type(v)), v))
        if values:
            report[section] = {str(v): summary([r for r in records if extras(r).get(key) == v]) for v in values}
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    extra = [k for k in report["overall"] if k not in ("tasks", "exact_match", "f1")]

    def table(title: str, rows: dict[str, dict[str, float]]) -> list[str]:
        out = [
            f"{title:>8} {'tasks':>6} {'exact_match':>12} {'f1':>7}" + "".join(f" {k:>{max(len(k), 7)}}" for k in extra)
        ]
        for key, row in [*rows.items(), ("all", report["overall"])]:
            line = f"{key:>8} {row['tasks']:>6} {100 * row['exact_match']:>11.1f}% {100 * row['f1']:>6.1f}%"
            for k in extra:
                width = max(len(k), 7) - 1
                line += f" {100 * row[k]:>{width}.1f}%" if k in row else " " * (width + 2)
            out.append(line)
        return out

    samples = f", {report['samples_per_task']:g} samples per task" if "samples_per_task" in report else ""
    lines = [f"Evaluation at step {report.get('step', '?')} ({report.get('model', '')}{samples})"]
    lines += table(report.get("unit", "chunks"), report["by_num_chunks"])
    for title, section in (("category", "by_category"), ("position", "by_answer_position"), ("hops", "by_hops")):
        if section in report:
            lines += table(title, report[section])
    return "\n".join(lines)


def write_evaluation(
    report: dict[str, Any], predictions: list[dict[str, Any]], log_dir: str, loggers: Sequence[Any] = ()
) -> None:
    """Print the report, hand it to ``loggers`` (:func:`~lightning_memrl.evaluation.tables.log_evaluation_report`)
    and save it as ``eval_report_step<N>.json`` next to ``eval_predictions_step<N>.jsonl``."""
    step = report["step"]
    text = format_report(report)
    print(text)
    log_evaluation_report(report, text, loggers)
    path = Path(log_dir) / f"eval_report_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    lines = "".join(json.dumps(row) + "\n" for row in predictions)
    (path.parent / f"eval_predictions_step{step}.jsonl").write_text(lines)


def _zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """1.0 for each group whose scored rewards are all equal (or fewer than two), else 0.0."""
    grouped = rewards.view(-1, group_size)
    return torch.tensor(
        [
            float(torch.nan_to_num(g[~torch.isnan(g)].std(), 0.0) == 0) if (~torch.isnan(g)).sum() > 1 else 1.0
            for g in grouped
        ]
    )


# optimizer steps skipped (non-finite), and turns left out of the passes because their gradient is zero
SKIP_COUNTS = ("skipped_steps", "skipped_tokens", "skipped_rows")


def step_metrics(
    rollouts: RolloutBatch,
    stats: dict[str, float],
    lr: float,
    timing: tuple[float, float, float],
    ppo_epochs: int,
    with_kl: bool,
) -> dict[str, float]:
    """A training step's ``train/*`` and ``time/*`` metrics.

    Args:
        rollouts: the step's scored rollouts.
        stats: the update's statistics (and the reward guard's counts).
        lr: the learning rate of the policy's parameter group.
        timing: seconds of the rollout, the update and the whole step.
        ppo_epochs: optimisation passes over the batch (for the update's token throughput).
        with_kl: add ``train/kl`` (every rank logs the same keys, one without turns too).
    """
    rollout_time, update_time, step_time = timing
    rewards = rollouts.rewards
    valid = rewards[~torch.isnan(rewards)]
    zero_std = _zero_std_groups(rewards, rollouts.group_size)
    lengths = rollouts.response_mask.sum(-1).float()
    is_mem = rollouts.memory_turns
    tokens = float(lengths.sum())
    metrics = {
        "train/reward": float(valid.mean()) if valid.numel() else math.nan,
        "train/reward_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "train/frac_reward_zero_std": float(zero_std.mean()),
        "train/nonfinite_rewards": stats.get("nonfinite_rewards", 0.0),
        "train/frac_reward_nan": stats.get("frac_reward_nan", 0.0),
        "train/advantage_abs": float(rollouts.trajectory_advantages.abs().mean()) if rollouts.num_trajectories else 0.0,
        "train/response_length": float(lengths[~is_mem].mean()) if (~is_mem).any() else 0.0,
        "train/memory_length": float(lengths[is_mem].mean()) if is_mem.any() else 0.0,
        "train/truncation_ratio": float(rollouts.truncated.float().mean()) if rollouts.truncated.numel() else 0.0,
        "train/turns_per_trajectory": rollouts.response_ids.shape[0] / max(rollouts.num_trajectories, 1),
        "train/loss": stats["loss"],
        "train/grad_norm": stats["grad_norm"],
        "train/clip_frac": stats.get("clip_frac", 0.0),
        "train/dual_clip_frac": stats.get("dual_clip_frac", 0.0),
        "train/entropy": stats.get("entropy", 0.0),
        "train/logprob_gap": stats["logprob_gap"],
        "train/lr": lr,
        "time/rollout_s": rollout_time,
        "time/reference_s": stats["reference_time"],
        "time/update_s": update_time,
        "time/step_s": step_time,
        "time/rollout_tokens_per_s": tokens / max(rollout_time, 1e-9),
        "time/update_tokens_per_s": tokens * ppo_epochs / max(update_time, 1e-9),
    }
    metrics.update({f"train/{key}": stats.get(key, 0.0) for key in SKIP_COUNTS})
    for key, value in stats.items():  # the loss options that are on (GRPOSettings): the same keys on every rank
        if key.startswith("loss_variant/"):
            metrics[f"train/{key}"] = value
    if with_kl:  # every rank logs the same keys (sync_dist), one without turns too
        metrics["train/kl"] = stats.get("kl", 0.0)
    for name, values in rollouts.reward_components.items():
        scored = values[~torch.isnan(values)]
        metrics[f"train/reward/{name}"] = float(scored.mean()) if scored.numel() else math.nan
    return metrics


def prediction_row(trajectory: Any, answer: str, em: float) -> dict[str, Any]:
    """A line of ``eval_predictions_step<N>.jsonl``: the task, the memory after each turn, the completion, its score,
    and for bank workflows the raw answer (``response``, citations included), the memories shown, those cited and
    (RMM) which shown memories hold the question's evidence (``evidence_rewards``, +1/−1 in ``shown_ids`` order)."""
    info = trajectory.info
    shown = {key: info.get(key) for key in ("shown_ids", "cited", "evidence_rewards")}
    shown["response"] = info.get("answer_raw")
    return {
        "id": trajectory.task.id,
        "question": trajectory.task.question,
        "answers": trajectory.task.answers,
        "chunks": len(trajectory.chunks),
        "memories": trajectory.memories,
        "completion": trajectory.final_text,
        "answer": answer,
        "exact_match": em,
        **{key: value for key, value in shown.items() if value is not None},
    }


@dataclass
class EvaluationLog:
    """One evaluation epoch's tasks: their records for :func:`evaluation_report` and their prediction rows."""

    records: list[tuple[int, float, float, dict[str, Any]]] = field(default_factory=list)  # (chunks, EM, F1, extras)
    predictions: list[dict[str, Any]] = field(default_factory=list)  # rows of eval_predictions_step<N>.jsonl
    unit: str = "chunks"  # what a context's parts are (a task's meta["context_unit"], e.g. LoCoMo's "sessions")
    bleu1_scores: list[float] = field(default_factory=list)  # BLEU-1 of each task, in order

    def add(self, trajectory: Trajectory, answer_pattern: str | None, workflow: Any) -> tuple[float, float]:
        """Score the trajectory's answer (exact match, token F1, BLEU-1, the workflow's ``evaluation_metrics``).

        Returns:
            Its exact match and F1 (its BLEU-1 is ``self.bleu1_scores[-1]``).
        """
        answer = answer_from_completion(trajectory.final_text, answer_pattern)
        answers = trajectory.task.answers
        em, f1 = exact_match(answer, answers), token_f1(answer, answers)
        self.bleu1_scores.append(bleu1(answer, answers))
        meta = trajectory.task.meta
        self.unit = meta.get("context_unit", self.unit)
        extras = {"category": meta.get("category"), "bleu1": self.bleu1_scores[-1], "hops": meta.get("hops")}
        if "answer_chunk" in meta:  # synthetic tasks: the 1-based position of the chunk stating the answer
            extras["answer_position"] = meta["answer_chunk"] + 1
        extras.update(workflow.evaluation_metrics(trajectory))
        self.records.append((len(trajectory.chunks), em, f1, extras))
        self.predictions.append(prediction_row(trajectory, answer, em))
        return em, f1

    def write(self, step: int, model: str, log_dir: str, is_global_zero: bool, loggers: Sequence[Any] = ()) -> None:
        """Gather every rank's tasks; global rank 0 prints the report, logs it to ``loggers`` and writes its files.

        Next to ``eval_report_step<N>.json`` (overall, by number of chunks, by category; ``unit`` names
        what was counted),
        ``eval_predictions_step<N>.jsonl`` holds one line per task: question, gold answers, the memory
        after each turn, the completion and its score.
        """
        records = distributed.gather_objects(self.records)
        predictions = distributed.gather_objects(self.predictions)
        if records and is_global_zero:
            info: dict[str, Any] = {"step": step, "model": model, "unit": self.unit}
            samples = len(predictions) / max(len({row["id"] for row in predictions}), 1)
            if samples > 1:  # generation.num_generations_eval: a row per sample, the means over all of them
                info["samples_per_task"] = samples
            report = evaluation_report(records, **info)
            write_evaluation(report, predictions, log_dir, loggers)
