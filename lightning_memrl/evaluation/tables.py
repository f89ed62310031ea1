"""Tables for the trainer's loggers: the evaluation report per bucket and sample completions of training steps.

- :func:`log_evaluation_report`: every number of the report's buckets (by number of chunks, or
  sessions, and by category) as scalars ``val_by_<unit>/<bucket>/<metric>`` and
  ``val_by_category/<category>/<metric>`` to every logger, and the printed report as the text
  ``evaluation/report`` to TensorBoard.
- :func:`log_completions`: a text table ``completions`` (task, the tail of the final prompt, the
  completion, its reward and advantage) of a step's first trajectories to TensorBoard, TRL's
  ``log_completions``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import WarningCache

from lightning_memrl.types import RolloutBatch

PROMPT_TAIL_CHARS = 300  # characters of the final prompt shown before each completion
_warnings = WarningCache()


def tensorboard_writers(loggers: Sequence[Any]) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger among ``loggers``."""
    return [logger.experiment for logger in loggers if isinstance(logger, TensorBoardLogger)]


def report_scalars(report: dict[str, Any]) -> dict[str, float]:
    """``val_by_<unit>/<bucket>/<metric>`` and ``val_by_category/<category>/<metric>`` of an evaluation report."""
    unit = report.get("unit", "chunks")
    scalars = {}
    groups = {f"val_by_{unit}": report["by_num_chunks"], "val_by_category": report.get("by_category", {})}
    for group, rows in groups.items():
        for bucket, row in rows.items():
            scalars.update({f"{group}/{bucket}/{name}": float(v) for name, v in row.items() if name != "tasks"})
    return scalars


def log_evaluation_report(report: dict[str, Any], text: str, loggers: Sequence[Any]) -> None:
    """Log the report's bucket scalars (every logger) and its printed ``text`` (TensorBoard) at the report's step."""
    step = int(report.get("step", 0))
    scalars = report_scalars(report)
    for logger in loggers:
        logger.log_metrics(scalars, step=step)
    for writer in tensorboard_writers(loggers):
        writer.add_text("evaluation/report", "\n".join("    " + line for line in text.splitlines()), step)


def _cell(value: Any) -> str:
    """One Markdown table cell: line breaks (any that ``str.splitlines`` knows) shown as ↵, other control
    characters as spaces, pipes escaped."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}"
    text = " ↵ ".join(str(value).splitlines())
    return "".join(c if c.isprintable() else " " for c in text).replace("|", "\\|")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` (dicts with the same keys) as a Markdown table, as TensorBoard's text tab renders it."""
    if not rows:
        return ""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def completion_rows(rollouts: RolloutBatch, tokenizer: Any, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` (None: all) trajectories: task id, final prompt's tail, completion, reward, advantage."""
    rows = []
    advantages = rollouts.trajectory_advantages
    for i, trajectory in enumerate(rollouts.trajectories[:limit]):
        prompt = tokenizer.decode(trajectory.turns[-1].prompt_ids, skip_special_tokens=True) if trajectory.turns else ""
        tail = prompt if len(prompt) <= PROMPT_TAIL_CHARS else "…" + prompt[-PROMPT_TAIL_CHARS:]
        rows.append(
            {
                "task": trajectory.task.id or str(i // rollouts.group_size),
                "prompt (tail)": tail,
                "completion": trajectory.final_text,
                "reward": float(rollouts.rewards[i]),
                "advantage": float(advantages[i]) if advantages.numel() > i else math.nan,
            }
        )
    return rows


def due(step: int, steps_per_batch: int, every: int) -> bool:
    """Whether a batch of ``steps_per_batch`` optimizer steps ending at ``step`` passed a multiple of ``every``.

    ``every`` is ``trainer.log_every_n_steps``; with ``ppo_epochs`` > 1 a batch takes several steps at once.
    """
    return step // every != (step - steps_per_batch) // every


def log_completions(
    rollouts: RolloutBatch, tokenizer: Any, loggers: Sequence[Any], step: int, limit: int | None
) -> int:
    """Log the step's first ``limit`` trajectories as the TensorBoard text ``completions`` at ``step``.

    Returns:
        The number of rows logged (0 without a TensorBoard logger, which is warned about once).
    """
    writers = tensorboard_writers(loggers)
    if not writers:
        _warnings.warn("grpo.log_completions: no TensorBoardLogger among trainer.logger, so no completions are logged")
        return 0
    rows = completion_rows(rollouts, tokenizer, limit)
    for writer in writers:
        writer.add_text("completions", markdown_table(rows), step)
    return len(rows)


def log_step_completions(module: Any, rollouts: RolloutBatch) -> int:
    """TRL's ``log_completions`` for a ``MemRLModule`` after its update: when ``grpo.log_completions`` is on
    and the step is due (every ``trainer.log_every_n_steps`` optimizer steps), :func:`log_completions` of
    ``grpo.num_completions_to_print`` trajectories at the optimizer step.

    Returns:
        The number of rows logged.
    """
    grpo, step = module.grpo, module.global_step
    if not grpo.log_completions or not due(step, grpo.ppo_epochs, module.trainer.log_every_n_steps):
        return 0
    return log_completions(rollouts, module.tokenizer, module.loggers, step, grpo.num_completions_to_print)
