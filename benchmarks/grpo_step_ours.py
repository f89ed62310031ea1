"""Our side of ``grpo_step.py``: one GRPO step through ``MemRLModule`` and a Lightning ``Trainer``.

Run by ``grpo_step.py`` in its own process (``python benchmarks/grpo_step_ours.py <grpo_step args>
--model_path DIR --worker_out FILE``); writes the measured steps as JSON to ``--worker_out``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import tempfile
import time
from typing import Any

import bench_utils as bu
import lightning as L
from grpo_step import ANSWER, PROMPT, finish_step, worker_main, worker_result
from torch.utils.data import DataLoader

from lightning_memrl import (
    GenerationSettings,
    GroupRelative,
    GRPOSettings,
    LoraSettings,
    MemAgentWorkflow,
    MemRLModule,
    OptimizerSettings,
    Task,
    Trajectory,
    Turn,
    Workflow,
)
from lightning_memrl.rewards import TokenF1
from lightning_memrl.types import ANSWER_TURN


class SingleTurnWorkflow(Workflow):
    """One turn per trajectory: the question through the chat template, one response (TRL's GRPO)."""

    def __init__(self) -> None:
        self.chat = MemAgentWorkflow()  # only for its chat-template prompt encoding
        self.prompt_ids: list[int] = []
        self.generated = 0

    def rollout(self, engine: Any, tasks: list[Any], settings: Any) -> list[Any]:
        prompts = [self.chat.encode_prompt(task.question, engine.tokenizer) for task in tasks]
        generations = engine.generate(prompts, settings)
        self.prompt_ids, self.generated = prompts[0], sum(len(g.token_ids) for g in generations)
        return [
            Trajectory(
                task=task,
                turns=[Turn(ANSWER_TURN, p, g, engine.tokenizer.decode(g.token_ids, skip_special_tokens=True))],
            )
            for task, p, g in zip(tasks, prompts, generations)
        ]


class StepTimer(L.Callback):
    """Each step's phases from the module's ``time/*`` metrics and its wall time between the batch hooks."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step_s = time.perf_counter() - self.start
        m = {k: float(v) for k, v in trainer.callback_metrics.items()}
        phases = {
            "rollout_s": m["time/rollout_s"],
            "reference_s": m["time/reference_s"],
            "update_s": m["time/update_s"] - m["time/reference_s"],
        }
        self.steps.append(finish_step(phases, step_s, module.workflow.generated))


def ours_kwargs(text: str) -> dict[str, Any]:
    """``--ours_kwargs`` as MemRLModule arguments; ``rollout`` as in YAML: ``{"class_path": ..., "init_args": ...}``."""
    kwargs = json.loads(text)
    if isinstance(kwargs.get("rollout"), dict):
        module_name, _, name = kwargs["rollout"]["class_path"].rpartition(".")
        backend = getattr(importlib.import_module(module_name), name)
        kwargs["rollout"] = functools.partial(backend, **kwargs["rollout"].get("init_args", {}))
    return kwargs


def build_module(args: argparse.Namespace, workflow: Workflow) -> MemRLModule:
    """The module with TRL's settings: k3 KL, clip 0.2, token-mean loss, one PPO epoch, exact lengths."""
    lora = LoraSettings(r=args.lora_r, lora_alpha=2 * args.lora_r) if args.lora_r else None
    module = MemRLModule(
        model_name_or_path=args.model_path,
        dtype=args.dtype,
        lora=lora,
        workflow=workflow,
        rewards=[TokenF1()],
        generation=GenerationSettings(  # exactly new_tokens, as TRL (rollouts ignore generation_config)
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens},
        ),
        advantage=GroupRelative(scale_rewards="group"),
        grpo=GRPOSettings(
            group_size=args.group,
            loss_aggregation="token_mean",
            clip_low=0.2,
            clip_high=0.2,
            kl_coef=args.beta,
            kl_estimator="k3",
            ppo_epochs=1,
            max_grad_norm=1.0,
        ),
        optimizer=OptimizerSettings(lr=args.lr),
        **ours_kwargs(args.ours_kwargs),
    )
    module.configure_model()  # idempotent: fit does not load again
    return module


def fit(args: argparse.Namespace, module: MemRLModule, timer: StepTimer) -> None:
    """``--warmup`` + ``--steps`` steps on CPU, one task (the prompt) per step, nothing saved."""
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision=args.precision,
            max_steps=total,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
            callbacks=[timer],
        )
        tasks = [Task(question=PROMPT, context=[PROMPT], answers=[ANSWER], id=str(i)) for i in range(total)]
        trainer.fit(module, train_dataloaders=DataLoader(tasks, batch_size=1, collate_fn=list))


def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Our GRPO step through ``MemRLModule`` and a Lightning ``Trainer``, as ``lightning-memrl fit`` runs it."""
    bu.set_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    workflow = SingleTurnWorkflow()
    module = build_module(args, workflow)
    loaded_rss = bu.rss_mib()
    timer = StepTimer()
    fit(args, module, timer)
    settings = f"dtype={args.dtype}, precision={args.precision}, lora_r={args.lora_r}, ours_kwargs={args.ours_kwargs}"
    return worker_result(settings, timer.steps, workflow.prompt_ids, module.policy, loaded_rss)


if __name__ == "__main__":
    worker_main(worker_ours)
