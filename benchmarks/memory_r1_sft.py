"""Memory-SFT's effect on Memory-R1's manager: the valid-operation rate before and after the warm start.

The manager runs greedily on the prompts of a held-apart conversation's annotated facts (the prompts
the RL stage writes; see ``lightning_memrl.sft.targets``); an output is valid when the RL stage's
parser reads an operation from it that the bank can apply. Then the SFT stage (``MemorySFTModule``,
LoRA as configs/memory_r1/sft.yaml) trains on the training conversations' targets for ``--steps``
optimizer steps, and the rate is measured again. Results go to
``benchmarks/results/memory_r1_sft_<model>.json`` with the machine.

    python benchmarks/memory_r1_sft.py --locomo PATH --train conv-26 --held-apart conv-43 --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import machine, model_tag, resolve_model, set_threads  # noqa: E402

from lightning_memrl.adapters import LoraSettings  # noqa: E402
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo  # noqa: E402
from lightning_memrl.rollout.hf import RolloutEngine  # noqa: E402
from lightning_memrl.settings import OptimizerSettings  # noqa: E402
from lightning_memrl.sft import MemorySFTDataModule, MemorySFTModule, build_sft_examples  # noqa: E402
from lightning_memrl.sft.evaluate import valid_operation_rate  # noqa: E402
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--locomo", required=True, help="LoCoMo JSON file or folder (with session_N_observation)")
    p.add_argument("--train", nargs="+", required=True, help="training conversation ids")
    p.add_argument("--held-apart", required=True, help="the conversation whose facts measure the rate")
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder or tiny")
    p.add_argument("--steps", type=int, default=20, help="SFT optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="SFT examples per step")
    p.add_argument("--lr", type=float, default=1e-3, help="SFT learning rate (LoRA)")
    p.add_argument("--max-sessions", type=int, default=2, help="sessions read per conversation")
    p.add_argument("--facts", type=int, default=12, help="held-apart facts measured")
    p.add_argument("--parts", nargs="+", default=["manage"], help="agents trained: extract manage answer")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/memory_r1_sft_<model>.json)")
    return p.parse_args()


def _sft(module: MemorySFTModule, data: MemorySFTDataModule, steps: int) -> tuple[float, float]:
    """Train ``module`` for ``steps`` optimizer steps; returns the seconds taken and the last loss."""
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    module.policy.eval()
    return time.perf_counter() - start, float(trainer.callback_metrics.get("train/loss", float("nan")))


def main() -> None:
    args = _args()
    set_threads(args.threads)
    L.seed_everything(0)
    workflow = MemoryR1Workflow(max_facts=3, manager_top_k=3, answer_top_k=8)  # configs/memory_r1/locomo.yaml
    held = load_locomo(args.locomo, LoCoMoSettings(max_sessions=args.max_sessions, conversations=[args.held_apart]))
    examples = build_sft_examples(workflow, held, ["manage"])[0][: args.facts]
    name = resolve_model(args.model, Path("logs/bench_memory_r1_sft"))
    module = MemorySFTModule(name, lora=LoraSettings(r=16, lora_alpha=32), optimizer=OptimizerSettings(lr=args.lr))
    module.configure_model()
    engine = RolloutEngine(module.policy, module.tokenizer)
    start = time.perf_counter()
    before = valid_operation_rate(workflow, engine, examples)
    eval_s = time.perf_counter() - start
    print(f"before: {before['valid']}/{before['facts']} valid ({before['rate']:.0%})", flush=True)
    data = MemorySFTDataModule(
        args.locomo,
        LoCoMoSettings(max_sessions=args.max_sessions, conversations=args.train),
        workflow,
        args.parts,
        args.batch_size,
    )
    train_s, final_loss = _sft(module, data, args.steps)
    after = valid_operation_rate(workflow, RolloutEngine(module.policy, module.tokenizer), examples)
    print(f"after {args.steps} SFT steps: {after['valid']}/{after['facts']} valid ({after['rate']:.0%})", flush=True)
    result = {
        "model": args.model,
        "train": args.train,
        "held_apart": args.held_apart,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "parts": args.parts,
        "max_sessions": args.max_sessions,
        "train_examples": len(data.examples),
        "final_train_loss": final_loss,
        "before": before,
        "after": after,
        "eval_seconds_before": round(eval_s, 1),
        "train_seconds": round(train_s, 1),
        "machine": machine(args.threads),
    }
    out = Path(args.out or f"benchmarks/results/memory_r1_sft_{model_tag(args.model)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
