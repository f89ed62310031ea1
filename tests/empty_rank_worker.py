"""Two-process FSDP2 run (CPU, gloo) where rank 1 never has a trainable turn (tests/test_callback_workflows.py).

``python tests/empty_rank_worker.py OUT_DIR`` trains 2 steps of the tiny model with ``FSDP2Strategy``
(Lightning relaunches this script for rank 1). On rank 1 every turn is a frozen agent's
(``trainable=False``), so it has no micro-batch while rank 0 has several; it must still join each
collective forward/backward. Each rank writes what it saw to ``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from helpers import AnswerLength

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
)
from lightning_memrl.callbacks import MemRLCallback
from lightning_memrl.distributed import FSDP2Strategy


class FrozenOnRankOne(MemAgentWorkflow):
    """MemAgent whose turns on rank 1 all belong to a frozen agent (no loss, no micro-batch)."""

    def rollout(self, engine, tasks, settings):
        trajectories = super().rollout(engine, tasks, settings)
        if torch.distributed.get_rank() == 1:
            for trajectory in trajectories:
                for turn in trajectory.turns:
                    turn.trainable = False
        return trajectories


def full_weights(module: MemRLModule) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in module.policy.state_dict().items()}


class Recorder(MemRLCallback):
    def __init__(self) -> None:
        self.record: dict = {"turns": [], "logged": []}

    def on_train_start(self, trainer, module) -> None:
        self.record["initial"] = full_weights(module)

    def on_rewards(self, trainer, module, rollouts) -> None:
        self.record["turns"].append(rollouts.response_ids.shape[0])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        keys = ("train/loss", "train/kl", "train/truncation_ratio", "train/grad_norm")
        self.record["logged"].append({k: float(trainer.logged_metrics[k]) for k in keys})

    def on_train_end(self, trainer, module) -> None:
        self.record["end"] = full_weights(module)
        self.record["global_step"] = trainer.global_step


def main(out: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(timeout=timedelta(seconds=60)),  # a rank out of step fails, it does not hang
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        default_root_dir=out,
        callbacks=[recorder],
    )
    module = MemRLModule(
        workflow=FrozenOnRankOne(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, kl_coef=0.1, micro_batch_tokens=1),  # one turn per micro-batch
        optimizer=OptimizerSettings(lr=1e-2),
    )
    data = MemRLDataModule(
        batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=8, min_chunks=1, max_chunks=2, sentences_per_chunk=1)
    )
    trainer.fit(module, data)
    torch.save(recorder.record, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
