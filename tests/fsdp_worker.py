"""Two-process FSDP2 run of the tiny model on CPU (gloo), driven by tests/test_distributed.py.

``python tests/fsdp_worker.py OUT_DIR`` trains 2 steps with ``FSDP2Strategy`` (Lightning's
``ModelParallelStrategy`` with data_parallel_size = world size, tensor_parallel_size = 1; Lightning
relaunches this script for rank 1), saves a sharded checkpoint, resumes it for a third step, and
writes what each rank saw to ``OUT_DIR/rank{R}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from helpers import AnswerLength
from lightning.pytorch.callbacks import ModelCheckpoint

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
from lightning_memrl.distributed import FSDP2Strategy, is_unsharded


def full_weights(module: MemRLModule) -> dict[str, torch.Tensor]:
    """Every rank's view of the whole policy (an all-gather of the shards)."""
    return {k: v.full_tensor().clone() for k, v in module.policy.state_dict().items()}


class Recorder(MemRLCallback):
    """Records shards, weights, tasks and metrics on each rank."""

    def __init__(self) -> None:
        self.record: dict = {"task_ids": [], "local_reward": [], "unsharded_after_rollout": []}

    def on_train_start(self, trainer, module) -> None:
        policy = module.policy
        self.record.setdefault(
            "shapes",
            {k: (tuple(v.shape), tuple(v.to_local().shape)) for k, v in policy.state_dict().items()},
        )
        self.record.setdefault("is_dtensor", all(type(p).__name__ == "DTensor" for p in policy.parameters()))
        ref = module._reference
        self.record.setdefault("reference_dtensor", all(type(p).__name__ == "DTensor" for p in ref.parameters()))
        self.record.setdefault("initial", full_weights(module))
        self.record.setdefault("mesh", dict(zip(module.device_mesh.mesh_dim_names, module.device_mesh.shape)))
        self.record.setdefault("buffers", {k: v.clone() for k, v in policy.named_buffers()})
        self.record[f"start_{trainer.max_steps}"] = full_weights(module)

    def on_rewards(self, trainer, module, rollouts) -> None:
        self.record["task_ids"].append([t.task.id for t in rollouts.trajectories])
        self.record.setdefault("turns", []).append(rollouts.response_ids.shape[0])  # = micro-batches here
        self.record["local_reward"].append(float(rollouts.rewards.mean()))
        self.record["unsharded_after_rollout"].append(is_unsharded(module.policy))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.record.setdefault("logged_reward", []).append(float(trainer.logged_metrics["train/reward"]))

    def on_train_end(self, trainer, module) -> None:
        self.record[f"end_{trainer.max_steps}"] = full_weights(module)
        self.record[f"global_step_{trainer.max_steps}"] = trainer.global_step
        self.record["local_shards"] = {k: v.to_local().clone() for k, v in module.policy.state_dict().items()}


def trainer(out: Path, steps: int, recorder: Recorder) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDP2Strategy(),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=out,
        callbacks=[recorder, ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=2)],
    )


def module() -> MemRLModule:
    return MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, kl_coef=0.1, micro_batch_tokens=1),  # one turn per micro-batch
        optimizer=OptimizerSettings(lr=1e-2),
    )


def data() -> MemRLDataModule:
    return MemRLDataModule(
        batch_size=2,
        synthetic=SyntheticTaskSettings(num_tasks=8, min_chunks=1, max_chunks=3, sentences_per_chunk=1),
    )


def main(out: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    first = trainer(out, 2, recorder)
    first.fit(module(), data())
    second = trainer(out, 3, recorder)
    second.fit(module(), data(), ckpt_path=str(out / "ckpt" / "last.ckpt"))
    recorder.record["world_size"] = second.world_size
    torch.save(recorder.record, out / f"rank{second.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
