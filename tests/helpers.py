"""Test helpers shared by several test files."""

from __future__ import annotations

import lightning as L

from lightning_memrl.rewards import RewardFunction


class AnswerLength(RewardFunction):
    """Varies across group members even for an untrained model, so advantages are not all zero."""

    default_name = "answer_length"

    def score(self, completion: str, answers: list[str]) -> float:
        return len(completion) / 10


def quiet_trainer(tmp_path, steps: int = 2, callbacks=()) -> L.Trainer:
    """A CPU trainer without loggers, checkpoints, progress bar or validation."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
    )
