"""A few GRPO steps of a randomly initialised model: rollout/update tokens per second and peak memory.

``python benchmarks/gpu_smoke.py --size 0.5b --steps 4 --attn sdpa flash_attention_2`` (what
``benchmarks/gpu_smoke.sh`` runs on a GPU). ``--size tiny`` runs the same code in seconds on a CPU.
The weights are random (the tiny offline tokenizer, 640 tokens), so answers are noise and rarely
end early: every turn generates its full budget, which makes the numbers comparable across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
)
from lightning_memrl.models import build_tiny_tokenizer
from lightning_memrl.rewards import TokenF1

SIZES = {  # Llama-style shapes; "0.5b" has 505M parameters with the 640-token vocabulary
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "heads": 4, "kv_heads": 2},
    "0.5b": {"hidden_size": 1152, "intermediate_size": 5120, "num_hidden_layers": 24, "heads": 16, "kv_heads": 4},
}


class StepTimes(L.Callback):
    """Collects each step's time metrics."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({k: float(v) for k, v in metrics.items() if k.startswith("time/")})


def save_random_model(size: str, directory: Path) -> int:
    """Save a random model of ``size`` with the tiny tokenizer; returns its parameter count."""
    tokenizer = build_tiny_tokenizer()
    shape = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=8192,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def run(model_dir: str, attn: str, args: argparse.Namespace) -> dict[str, float | str]:
    """``args.steps`` GRPO steps; medians over the steps after the first."""
    cuda = torch.cuda.is_available()
    module = MemRLModule(
        model_name_or_path=model_dir,
        dtype="bfloat16" if cuda else "float32",
        attn_implementation=attn,
        workflow=MemAgentWorkflow(max_memory_tokens=args.memory_tokens, chunk_tokens=args.chunk_tokens, max_chunks=3),
        rewards=[TokenF1()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=args.answer_tokens),
        grpo=GRPOSettings(group_size=args.group_size, kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens),
        optimizer=OptimizerSettings(lr=1e-6),
        gradient_checkpointing=args.gradient_checkpointing,
    )
    data = MemRLDataModule(
        batch_size=args.tasks,
        synthetic=SyntheticTaskSettings(
            num_tasks=args.tasks * args.steps, min_chunks=3, max_chunks=3, sentences_per_chunk=args.sentences
        ),
    )
    times = StepTimes()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[times],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, data)
    wall = time.perf_counter() - start
    steady = times.rows[1:] or times.rows

    def median(key: str) -> float:
        return statistics.median(row[key] for row in steady)

    return {
        "attn_implementation": attn,
        "steps": len(times.rows),
        "wall_s": round(wall, 2),
        "step_s": round(median("time/step_s"), 3),
        "rollout_s": round(median("time/rollout_s"), 3),
        "update_s": round(median("time/update_s"), 3),
        "rollout_tokens_per_s": round(median("time/rollout_tokens_per_s"), 1),
        "update_tokens_per_s": round(median("time/update_tokens_per_s"), 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b", help="model shape")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps (the first is warm-up)")
    parser.add_argument("--attn", nargs="+", default=["sdpa", "flash_attention_2"], help="backends to compare")
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task")
    parser.add_argument("--sentences", type=int, default=40, help="filler sentences per chunk (context length)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="chunk size")
    parser.add_argument("--memory-tokens", type=int, default=128, help="memory budget per turn")
    parser.add_argument("--answer-tokens", type=int, default=32, help="answer budget")
    parser.add_argument("--micro-batch-tokens", type=int, default=32768, help="padded tokens per micro-batch")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layers in backward")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    results: dict[str, object] = {
        "size": args.size,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        results["parameters"] = save_random_model(args.size, Path(tmp))
        print(f"random {args.size} model: {results['parameters'] / 1e6:.1f}M parameters", flush=True)
        for attn in args.attn:
            if attn == "flash_attention_2" and (
                not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None
            ):
                print(f"skipping {attn}: needs CUDA and the flash-attn package (pip install -e '.[gpu]')", flush=True)
                continue
            row = run(tmp, attn, args)
            results["runs"].append(row)  # type: ignore[union-attr]
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not results["runs"]:
        sys.exit("no backend ran")


if __name__ == "__main__":
    main()
