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
process (``grpo_step_ours.py``, ``grpo_step_trl.py``) with ``torch.set_num_threads(--threads)`` on
the same model folder, prompt (one prompt of 58 tokens with SmolLM2's chat template, repeated
``--group`` times), group size, exactly ``--new_tokens`` new tokens per completion
(``min_new_tokens`` = ``max_new_tokens`` on both),
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
markdown table to stdout and JSON to ``benchmarks/results/grpo_step_<model>[_lora<r>][_<tag>].json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_utils as bu

PROMPT = "The secret code of Bruno is 7390. What is the secret code of Bruno? Reply with the four digits only."
ANSWER = "7390"
PHASES = ["rollout_s", "reference_s", "update_s", "other_s", "step_s"]
POST_IMPORT_RSS_MIB = 0.0  # a worker's RSS once its imports are done (set by worker_main)
WORKERS = {side: Path(__file__).with_name(f"grpo_step_{side}.py") for side in ("ours", "trl")}  # one process a side
LABELS = {
    "rollout_s": "rollout (s)",
    "reference_s": "reference (s)",
    "update_s": "update (s)",
    "other_s": "other (s)",
    "step_s": "**step (s)**",
    "tokens_per_s": "generated tokens/s",
    "loaded_rss_mib": "RSS after loading (MiB)",
    "peak_rss_mib": "peak RSS (MiB)",
    "model_mib": "policy weights (MiB)",
    "post_import_rss_mib": "RSS after the imports (MiB)",
    "peak_over_weights": "(peak RSS - RSS after the imports) / policy weights",
}


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
    parser.add_argument("--ours_kwargs", default="{}", help="JSON of extra MemRLModule arguments (e.g. rollout)")
    parser.add_argument("--sides", default="ours,trl", help="comma-separated sides to run: ours, trl")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. the machine kind)")
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


def finish_step(phases: dict[str, float], step_s: float, generated: int) -> dict[str, float]:
    """A step's phases with its wall time, the time outside the three phases and the generated tokens."""
    known = phases["rollout_s"] + phases["reference_s"] + phases["update_s"]
    return {**phases, "step_s": step_s, "other_s": step_s - known, "generated_tokens": float(generated)}


# --------------------------------------------------------------------------- workers
def worker_result(
    settings: str, steps: list[dict[str, float]], prompt_ids: list[int], model: Any, loaded_rss: float
) -> dict[str, Any]:
    """What a side's worker reports: its settings, every step, the prompt's token ids, weight size and memory."""
    return {
        "settings": settings,
        "steps": steps,
        "prompt_ids": prompt_ids,
        "model_mib": bu.param_mib(model),
        "loaded_rss_mib": loaded_rss,
        "peak_rss_mib": bu.peak_rss_mib(),
        "post_import_rss_mib": POST_IMPORT_RSS_MIB,
    }


def worker_main(worker: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """A side's worker script: read the driver's options, run ``worker``, write its result to ``--worker_out``."""
    global POST_IMPORT_RSS_MIB
    POST_IMPORT_RSS_MIB = bu.rss_mib()  # the worker's imports are done: its baseline
    args = parse_args()
    Path(args.worker_out).write_text(json.dumps(worker(args)))


# --------------------------------------------------------------------------- driver
def worker_argv(args: argparse.Namespace, model_path: str) -> list[str]:
    """The arguments a side's worker process gets: the work and precision options and the model folder."""
    keys = ["model", "group", "new_tokens", "beta", "lr", "lora_r", "steps", "warmup", "threads", "seed"]
    keys += ["dtype", "precision", "trl_precision", "ours_kwargs"]
    argv = [f"--{k}={getattr(args, k)}" for k in keys]
    return [*argv, "--model_path", model_path]


def run_sides(args: argparse.Namespace, sides: list[str]) -> dict[str, dict[str, Any]]:
    """Each side's worker result, every side on the same model folder."""
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bu.resolve_model(args.model, Path(tmp))
        return {side: bu.run_worker(str(WORKERS[side]), worker_argv(args, model_path), side) for side in sides}


def side_results(args: argparse.Namespace, raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per side: the step medians, memory, settings, prompt length and every step; warns of a short generation."""
    results: dict[str, Any] = {}
    for side, r in raw.items():
        summary = step_summary(r["steps"], args.warmup)
        expected = args.group * args.new_tokens
        if summary["generated_tokens"] != expected:
            print(f"warning: {side} generated {summary['generated_tokens']} tokens per step, not {expected}")
        keys = ("settings", "model_mib", "loaded_rss_mib", "peak_rss_mib", "post_import_rss_mib")
        results[side] = {**summary, **{k: r[k] for k in keys}}
        results[side]["peak_over_weights"] = (r["peak_rss_mib"] - r["post_import_rss_mib"]) / r["model_mib"]
        results[side]["prompt_tokens"] = len(r["prompt_ids"])
        results[side]["steps"] = r["steps"]
    return results


def ours_over_trl(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ratios ours / TRL of the phases, peak RSS and tokens/s (empty with one side)."""
    if len(results) != 2:
        return {}
    ratios = {key: bu.ratio(results["ours"][key], results["trl"][key]) for key in [*PHASES, "peak_rss_mib"]}
    ratios["tokens_per_s"] = bu.ratio(results["ours"]["tokens_per_s"], results["trl"]["tokens_per_s"])
    return ratios


def result_record(
    args: argparse.Namespace, argv: list[str] | None, results: dict[str, Any], ratios: dict[str, float], same: bool
) -> dict[str, Any]:
    """What the result file holds: the command, the machine, the work both sides did, each side and the ratios."""
    command = "python benchmarks/grpo_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    first = next(iter(results.values()))
    return {
        "command": command.strip(),
        "machine": bu.machine(args.threads),
        "work": {
            "model": args.model,
            "prompts_per_step": 1,
            "prompt_tokens": first["prompt_tokens"],
            "same_prompt_ids": same,
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = set(sides) - {"ours", "trl"}
    if unknown or not sides:
        raise SystemExit(f"--sides: use 'ours', 'trl' or 'ours,trl', got {args.sides!r}")
    raw = run_sides(args, sides)
    results = side_results(args, raw)
    same_prompt = len(raw) < 2 or raw["ours"]["prompt_ids"] == raw["trl"]["prompt_ids"]
    if not same_prompt:
        print("warning: the two sides generated from different prompt token ids")
    ratios = ours_over_trl(results)
    headers, rows = bu.comparison_table(LABELS, results, sides, ratios, {"ours": "ours", "trl": "TRL"}, "ours / TRL")
    result = result_record(args, argv, results, ratios, same_prompt)
    tag = bu.model_tag(args.model) + (f"_lora{args.lora_r}" if args.lora_r else "")
    path = bu.write_result(bu.tagged(f"grpo_step_{tag}", args.tag), result)
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
