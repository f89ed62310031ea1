"""TRL's side of ``grpo_step.py``: one step of TRL 1.16's ``GRPOTrainer``, its phases timed.

Run by ``grpo_step.py`` in its own process (``python benchmarks/grpo_step_trl.py <grpo_step args>
--model_path DIR --worker_out FILE``); writes the measured steps as JSON to ``--worker_out``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import bench_utils as bu
import torch
import trl
from datasets import Dataset
from grpo_step import ANSWER, PROMPT, finish_step, worker_main, worker_result
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from lightning_memrl.rewards import TokenF1


class TimedGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that adds up the time spent in generation, reference and scoring per step."""

    phases: dict[str, float] = {}
    generated = 0
    prompt_ids: list[int] = []

    def _generate(self, prompts: list) -> Any:
        start = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            self.phases["rollout_s"] += time.perf_counter() - start

    def _generate_single_turn(self, prompt_ids: list, *rest: Any, **kwargs: Any) -> Any:
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
        self.prompt_ids = list(prompt_ids[0])
        self.generated += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    def _get_per_token_logps_and_entropies(self, model: Any, *rest: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super()._get_per_token_logps_and_entropies(model, *rest, **kwargs)
        finally:
            reference = (model is self.ref_model and model is not None) or (
                self.ref_model is None and not torch.is_grad_enabled()
            )
            if reference:
                self.phases["reference_s"] += time.perf_counter() - start

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.phases["generate_and_score_s"] += time.perf_counter() - start


class StepTimer(TrainerCallback):
    """Each step's phases from the trainer's timed methods and its wall time between the step hooks."""

    def __init__(self) -> None:
        self.trainer: TimedGRPOTrainer | None = None
        self.steps: list[dict[str, float]] = []
        self.start = 0.0

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        self.trainer.phases = dict.fromkeys(["rollout_s", "reference_s", "generate_and_score_s"], 0.0)
        self.trainer.generated = 0
        self.start = time.perf_counter()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        step_s = time.perf_counter() - self.start
        p = self.trainer.phases
        phases = {
            "rollout_s": p["rollout_s"],
            "reference_s": p["reference_s"],
            "update_s": step_s - p["generate_and_score_s"],
        }
        self.steps.append(finish_step(phases, step_s, self.trainer.generated))


def f1_reward_function() -> Any:
    """TRL's reward function: token F1 of each completion against its row's answer."""
    f1 = TokenF1()

    def f1_reward(completions: list, answer: list, **_: Any) -> list[float]:
        return [f1.score_answer(c[0]["content"], [a]) for c, a in zip(completions, answer)]

    return f1_reward


def peft_config(args: argparse.Namespace) -> Any:
    """LoRA of rank ``--lora_r`` (alpha 2r) on every linear layer, as ours; None for full fine-tuning."""
    if not args.lora_r:
        return None
    from peft import LoraConfig  # only under LoRA, so a full fine-tune's RSS does not count peft

    return LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def grpo_config(args: argparse.Namespace, output_dir: str) -> GRPOConfig:
    """TRL's settings matching ours: exact lengths, k3 KL (``beta``), clip 0.2, ``dapo`` loss, constant AdamW."""
    bf16 = args.trl_precision == "bf16"
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=args.beta,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=bf16,
        model_init_kwargs={"dtype": "bfloat16" if bf16 else "float32"},
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=args.seed,
        shuffle_dataset=False,
        dataloader_num_workers=0,
    )


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL 1.16 ``GRPOTrainer`` with its phases timed by wrapping its own methods."""
    bu.set_threads(args.threads)
    bf16 = args.trl_precision == "bf16"
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [{"prompt": [{"role": "user", "content": PROMPT}], "answer": ANSWER}] * (args.warmup + args.steps)
        trainer = TimedGRPOTrainer(
            model=args.model_path,
            reward_funcs=[f1_reward_function()],
            args=grpo_config(args, tmp),
            train_dataset=Dataset.from_list(rows),
            peft_config=peft_config(args),
            callbacks=[timer],
        )
        timer.trainer = trainer
        loaded_rss = bu.rss_mib()
        trainer.train()
    settings = (
        f"trl {trl.__version__}, bf16={bf16}, model dtype={'bfloat16' if bf16 else 'float32'}, lora_r={args.lora_r}"
    )
    return worker_result(settings, timer.steps, trainer.prompt_ids, trainer.model, loaded_rss)


if __name__ == "__main__":
    worker_main(worker_trl)
