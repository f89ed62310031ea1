"""Test helpers shared by several test files."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_memrl.models import LoraSettings, load_policy
from lightning_memrl.rewards import RewardFunction
from lightning_memrl.types import ANSWER_TURN, Generation, RolloutBatch, Task, Trajectory, Turn


class AnswerLength(RewardFunction):
    """Varies across group members even for an untrained model, so advantages are not all zero."""

    default_name = "answer_length"

    def score_answer(self, completion: str, answers: list[str]) -> float:
        return len(completion) / 10


def save_random_adapter(path, tokenizer, seed: int):
    """A tiny-model LoRA adapter (r 4, alpha 16) with random A and B, so it changes the model, saved by peft
    at ``path``; returns ``path``."""
    torch.manual_seed(seed)
    policy = load_policy("tiny", tokenizer, lora=LoraSettings(r=4, lora_alpha=16, init_lora_weights=False))
    policy.save_pretrained(path)
    return path


def answered(completion: str, answers: list[str], memories: list[str] | None = None) -> Trajectory:
    """A trajectory whose answer turn says ``completion`` to a task with gold ``answers``."""
    gen = Generation(token_ids=[1], logprobs=torch.zeros(1), truncated=False)
    task = Task(question="q", context=["c"], answers=answers)
    return Trajectory(task=task, turns=[Turn(ANSWER_TURN, [2], gen, completion)], memories=list(memories or []))


def sampler_and_learner_logprobs(
    module, policy, prompts: list[list[int]], gens: list[Generation]
) -> tuple[torch.Tensor, float]:
    """The learner's log-probs of the sampled tokens [B, T] (no grad) and their largest gap to the sampler's."""
    width = max(len(g.token_ids) for g in gens)
    ids = torch.zeros(len(gens), width, dtype=torch.long)
    mask = torch.zeros(len(gens), width, dtype=torch.long)
    for row, g in enumerate(gens):
        ids[row, : len(g.token_ids)] = torch.tensor(g.token_ids)
        mask[row, : len(g.token_ids)] = 1
    with torch.no_grad():
        learner, _ = module.sequence_logprobs(policy, prompts, ids, mask)
    gap = max(float((learner[row, : len(g.token_ids)].float() - g.logprobs).abs().max()) for row, g in enumerate(gens))
    return learner, gap


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


def turn_batch(
    rewards: list[float], group_size: int, turns: list[int], turn_rewards: list[float] | None = None
) -> RolloutBatch:
    """A batch whose turn ``m`` belongs to trajectory ``turns[m]``; 3 token slots per turn, the last one padding."""
    m = len(turns)
    return RolloutBatch(
        trajectories=[None] * len(rewards),  # type: ignore[list-item]
        group_size=group_size,
        prompt_ids=[[1]] * m,
        response_ids=torch.zeros(m, 3, dtype=torch.long),
        response_mask=torch.tensor([[1, 1, 0]] * m),
        rollout_logprobs=torch.zeros(m, 3),
        turn_to_trajectory=torch.tensor(turns),
        memory_turns=torch.zeros(m, dtype=torch.bool),
        truncated=torch.zeros(m, dtype=torch.bool),
        rewards=torch.tensor(rewards),
        turn_rewards=torch.tensor(turn_rewards if turn_rewards is not None else [0.0] * m),
    )


def sft_fit_losses(tmp_path, config: Path, root: str, *args: str) -> list[float]:
    """Run ``lightning-memrl fit`` of an SFT ``config`` on the tiny model (lr 0.01, constant, unshuffled) in
    ``tmp_path`` with further ``args``; the ``train/loss`` of each step from ``<tmp_path>/<root>/csv``."""
    exe = Path(sys.executable).with_name("lightning-memrl")
    command = [
        str(exe), "fit", "--config", str(config),
        "--model.init_args.model_name_or_path", "tiny",
        "--model.init_args.dtype", "float32",
        "--model.init_args.optimizer.lr", "0.01",
        "--model.init_args.optimizer.warmup_steps", "0",
        "--model.init_args.optimizer.schedule", "constant",
        "--data.init_args.shuffle", "false",
        *args,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = list(csv.DictReader(open(next((tmp_path / root / "csv").glob("version_*/metrics.csv")))))
    return [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def parsed_cli(args: list[str]):
    """The ``lightning-memrl`` parser's objects for ``args`` (model and data built, nothing run)."""
    from lightning_memrl.cli_parser import MemRLCLI

    return MemRLCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=args,
        save_config_callback=None,
    )


def scored_rollouts(module, tasks, rewards: list[float]) -> RolloutBatch:
    """Rollouts of the first two training tasks of ``tasks`` (set up), twice each, with ``rewards`` and advantages."""
    from lightning_memrl.advantages import assign_advantages

    rollouts = module.rollout([t for t in tasks.train_tasks[:2] for _ in range(2)], module.generation)
    rollouts.rewards = torch.tensor(rewards)
    assign_advantages(rollouts, module.advantage)
    return rollouts
