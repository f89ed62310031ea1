"""One GRPO step, ours against TRL's ``GRPOTrainer``, on identical work.

    python benchmarks/grpo_step.py                          # SmolLM2-135M-Instruct, 5 measured steps
    python benchmarks/grpo_step.py --model tiny             # the random tiny model (seconds)
    python benchmarks/grpo_step.py --steps 3 --warmup 1     # quicker
    python benchmarks/grpo_step.py --lora_r 16              # LoRA on both sides (result file ..._lora.json)
    python benchmarks/grpo_step.py --dtype bfloat16 --precision bf16-true --trl_precision bf16
    python benchmarks/grpo_step.py --steps 3 --warmup 1 --threads 1   # on a CPU other jobs share (see below)

``--threads 2`` (the default) is the setting to quote; on a CPU where other processes are busy,
two threads wait on each other (a tiny model's step measured 10x slower than with one thread), so
use ``--threads 1`` there and say so.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL 1.16). Each side runs in its own
process with ``torch.set_num_threads(--threads)`` on the same model folder, prompt (one prompt of
58 tokens with SmolLM2's chat template, repeated ``--group`` times), group size, exactly
``--new_tokens`` new tokens per completion (``min_new_tokens`` = ``max_new_tokens`` on both),
sampling (T=1, no top-p/top-k), KL coefficient ``--beta`` with the k3 estimator (TRL's), clip 0.2
on both sides, token-mean loss (TRL's ``dapo``), constant learning rate, AdamW
(``torch.optim.AdamW``, TRL ``optim=adamw_torch``), gradient clipping 1.0, no gradient
checkpointing, full fine-tuning unless ``--lora_r``; reward: token F1 of the completion against
the prompt's answer (``lightning_memrl.rewards.TokenF1`` on both sides).

Precision: ``auto`` (the default of ``--dtype``, ``--precision``, ``--trl_precision``) gives each
side its fastest setting on this CPU: bf16 weights (ours ``--dtype bfloat16 --precision
bf16-true``; TRL ``bf16=True``, ``model_init_kwargs={"dtype": "bfloat16"}``) where the CPU has
bf16 hardware (AVX512-BF16/AMX, as oneDNN reports), else float32 on both (without that hardware
a bf16 matrix product is an emulated one, over 10x slower than fp32).

Phases, measured (not derived from settings) in seconds per step:

* rollout: ours ``time/rollout_s`` (the workflow's turns: prompt encoding, ``generate``, decoding);
  TRL the time inside ``GRPOTrainer._generate`` (prompt tokenisation, ``generate``, decoding).
* reference: ours ``time/reference_s``; TRL the calls of ``_get_per_token_logps_and_entropies``
  on the reference model (or with adapters disabled under LoRA).
* update: policy forward/backward, clipping and the optimizer step. Ours ``time/update_s`` minus
  ``time/reference_s`` (the reference pass runs inside our update); TRL the step minus
  ``_generate_and_score_completions`` (generation, reference, rewards and advantages).
* other: the step minus the three phases (scoring, advantages, framework overhead).
* step: wall time from the framework's step-begin hook to its step-end hook
  (Lightning ``on_train_batch_start``/``end``, ``TrainerCallback.on_step_begin``/``end``).

Medians over ``--steps`` steps after ``--warmup`` warm-up steps. Tokens/s is generated tokens per
step over step time. Peak RSS is ``ru_maxrss`` of each side's process (imports, both models,
optimizer state and activations); ``loaded RSS`` is the RSS after the models were loaded. Writes a
markdown table to stdout and JSON to ``benchmarks/results/grpo_step_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_utils as bu

PROMPT = "The secret code of Bruno is 7390. What is the secret code of Bruno? Reply with the four digits only."
ANSWER = "7390"
PHASES = ["rollout_s", "reference_s", "update_s", "other_s", "step_s"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder, or tiny")
    parser.add_argument("--group", type=int, default=8, help="generations per prompt (group size)")
    parser.add_argument("--new_tokens", type=int, default=32, help="exact new tokens per completion")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference model)")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate (constant)")
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA rank on both sides (alpha 2r); 0 = full fine-tune")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (median)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps left out of the median")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each side")
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling on both sides")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="our weight dtype")
    parser.add_argument(
        "--precision", default="auto", help="our Lightning trainer precision: auto, 32-true, bf16-mixed, bf16-true"
    )
    parser.add_argument("--trl_precision", default="auto", choices=["auto", "bf16", "fp32"], help="TRL's precision")
    parser.add_argument("--ours_kwargs", default="{}", help="JSON of extra MemRLModule arguments (engine options)")
    parser.add_argument("--sides", default="ours,trl", help="comma-separated sides to run: ours, trl")
    parser.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model_path", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    bf16 = bu.cpu_bf16_supported()
    if args.dtype == "auto":
        args.dtype = "bfloat16" if bf16 else "float32"
    if args.precision == "auto":
        args.precision = "bf16-true" if bf16 else "32-true"
    if args.trl_precision == "auto":
        args.trl_precision = "bf16" if bf16 else "fp32"
    return args


def step_summary(steps: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Medians of the measured steps (after ``warmup``) of each phase, plus tokens/s."""
    measured = steps[warmup:]
    out: dict[str, Any] = {key: bu.median([s[key] for s in measured]) for key in PHASES}
    out["generated_tokens"] = bu.median([s["generated_tokens"] for s in measured])
    out["tokens_per_s"] = out["generated_tokens"] / out["step_s"]
    out["steps_measured"] = len(measured)
    return out


def _finish_step(phases: dict[str, float], step_s: float, generated: int) -> dict[str, float]:
    known = phases["rollout_s"] + phases["reference_s"] + phases["update_s"]
    return {**phases, "step_s": step_s, "other_s": step_s - known, "generated_tokens": float(generated)}


# --------------------------------------------------------------------------- ours
def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Our GRPO step through ``MemRLModule`` and a Lightning ``Trainer``, as ``lightning-memrl fit`` runs it."""
    bu.set_threads(args.threads)
    import lightning as L
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
            self.steps.append(_finish_step(phases, step_s, module.workflow.generated))

    L.seed_everything(args.seed, verbose=False)
    workflow = SingleTurnWorkflow()
    lora = LoraSettings(r=args.lora_r, alpha=2 * args.lora_r) if args.lora_r else None
    module = MemRLModule(
        model_name_or_path=args.model_path,
        dtype=args.dtype,
        lora=lora,
        workflow=workflow,
        rewards=[TokenF1()],
        generation=GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens),
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
        **json.loads(args.ours_kwargs),
    )
    module.configure_model()  # idempotent: fit does not load again
    module.policy.generation_config.min_new_tokens = args.new_tokens  # exactly new_tokens, as TRL below
    loaded_rss = bu.rss_mib()
    timer = StepTimer()
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
    return {
        "settings": f"dtype={args.dtype}, precision={args.precision}, lora_r={args.lora_r}, "
        f"ours_kwargs={args.ours_kwargs}",
        "steps": timer.steps,
        "prompt_ids": workflow.prompt_ids,
        "model_mib": bu.param_mib(module.policy),
        "loaded_rss_mib": loaded_rss,
        "peak_rss_mib": bu.peak_rss_mib(),
    }


# --------------------------------------------------------------------------- TRL
def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL 1.16 ``GRPOTrainer`` with its phases timed by wrapping its own methods."""
    bu.set_threads(args.threads)
    import torch
    import trl
    from datasets import Dataset
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
            self.steps.append(_finish_step(phases, step_s, self.trainer.generated))

    f1 = TokenF1()

    def f1_reward(completions: list, answer: list, **_: Any) -> list[float]:
        return [f1(c[0]["content"], [a]) for c, a in zip(completions, answer)]

    bf16 = args.trl_precision == "bf16"
    total = args.warmup + args.steps
    timer = StepTimer()
    peft_config = None
    if args.lora_r:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=2 * args.lora_r,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
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
            max_steps=total,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=True,
            seed=args.seed,
            shuffle_dataset=False,
            dataloader_num_workers=0,
        )
        rows = [{"prompt": [{"role": "user", "content": PROMPT}], "answer": ANSWER}] * total
        trainer = TimedGRPOTrainer(
            model=args.model_path,
            reward_funcs=[f1_reward],
            args=config,
            train_dataset=Dataset.from_list(rows),
            peft_config=peft_config,
            callbacks=[timer],
        )
        timer.trainer = trainer
        loaded_rss = bu.rss_mib()
        trainer.train()
    return {
        "settings": f"trl {trl.__version__}, bf16={bf16}, model dtype={'bfloat16' if bf16 else 'float32'}, "
        f"lora_r={args.lora_r}",
        "steps": timer.steps,
        "prompt_ids": trainer.prompt_ids,
        "model_mib": bu.param_mib(trainer.model),
        "loaded_rss_mib": loaded_rss,
        "peak_rss_mib": bu.peak_rss_mib(),
    }


# --------------------------------------------------------------------------- driver
def worker_argv(args: argparse.Namespace, side: str, model_path: str) -> list[str]:
    keys = ["model", "group", "new_tokens", "beta", "lr", "lora_r", "steps", "warmup", "threads", "seed"]
    keys += ["dtype", "precision", "trl_precision", "ours_kwargs"]
    argv = [f"--{k}={getattr(args, k)}" for k in keys]
    return [*argv, "--worker", side, "--model_path", model_path]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = worker_ours(args) if args.worker == "ours" else worker_trl(args)
        Path(args.worker_out).write_text(json.dumps(result))
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = set(sides) - {"ours", "trl"}
    if unknown or not sides:
        raise SystemExit(f"--sides: use 'ours', 'trl' or 'ours,trl', got {args.sides!r}")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bu.resolve_model(args.model, Path(tmp))
        raw = {side: bu.run_worker(__file__, worker_argv(args, side, model_path), side) for side in sides}
    results: dict[str, Any] = {}
    for side, r in raw.items():
        summary = step_summary(r["steps"], args.warmup)
        expected = args.group * args.new_tokens
        if summary["generated_tokens"] != expected:
            print(f"warning: {side} generated {summary['generated_tokens']} tokens per step, not {expected}")
        results[side] = {**summary, **{k: r[k] for k in ("settings", "model_mib", "loaded_rss_mib", "peak_rss_mib")}}
        results[side]["prompt_tokens"] = len(r["prompt_ids"])
        results[side]["steps"] = r["steps"]
    same_prompt = len(raw) < 2 or raw["ours"]["prompt_ids"] == raw["trl"]["prompt_ids"]
    if not same_prompt:
        print("warning: the two sides generated from different prompt token ids")
    ratios = {}
    if len(raw) == 2:
        ratios = {key: bu.ratio(results["ours"][key], results["trl"][key]) for key in [*PHASES, "peak_rss_mib"]}
        ratios["tokens_per_s"] = bu.ratio(results["ours"]["tokens_per_s"], results["trl"]["tokens_per_s"])
    rows = []
    labels = {
        "rollout_s": "rollout (s)",
        "reference_s": "reference (s)",
        "update_s": "update (s)",
        "other_s": "other (s)",
        "step_s": "**step (s)**",
        "tokens_per_s": "generated tokens/s",
        "loaded_rss_mib": "RSS after loading (MiB)",
        "peak_rss_mib": "peak RSS (MiB)",
        "model_mib": "policy weights (MiB)",
    }
    for key, label in labels.items():
        row = [label, *[results[s][key] for s in sides]]
        if ratios:
            row.append(ratios.get(key, float("nan")))
        rows.append(row)
    headers = ["", *[{"ours": "ours", "trl": "TRL"}[s] for s in sides]]
    if ratios:
        headers.append("ours / TRL")
    tag = bu.model_tag(args.model) + (f"_lora{args.lora_r}" if args.lora_r else "")
    command = "python benchmarks/grpo_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": command.strip(),
        "machine": bu.machine(args.threads),
        "work": {
            "model": args.model,
            "prompts_per_step": 1,
            "prompt_tokens": results[sides[0]]["prompt_tokens"],
            "same_prompt_ids": same_prompt,
            "group": args.group,
            "new_tokens": args.new_tokens,
            "beta": args.beta,
            "lr": args.lr,
            "lora_r": args.lora_r,
            "warmup_steps": args.warmup,
        },
        "sides": results,
        "ratio_ours_over_trl": ratios,
    }
    path = bu.write_result(f"grpo_step_{tag}", result)
    work = result["work"]
    print(
        f"GRPO step on {args.model}: 1 prompt x {work['group']} generations, {work['prompt_tokens']} prompt tokens, "
        f"{work['new_tokens']} new tokens, beta={work['beta']}, {args.threads} threads; medians of "
        f"{args.steps} steps after {args.warmup} warm-up"
    )
    for side in sides:
        print(f"  {side}: {results[side]['settings']}")
    print()
    print(bu.markdown_table(headers, rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
