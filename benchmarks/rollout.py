"""MemAgent rollout: our batched engine against a naive loop that generates one conversation at a time.

    python benchmarks/rollout.py                     # SmolLM2-135M-Instruct, 4 tasks x group 8 x 6 chunks of 512
    python benchmarks/rollout.py --small             # 2 tasks x group 4 x 3 chunks of 256 tokens, memory 64
    python benchmarks/rollout.py --model tiny        # the random tiny model
    python benchmarks/rollout.py --model tiny --small
    python benchmarks/rollout.py --small --threads 1   # on a CPU other jobs share (two threads stall there)
    python benchmarks/rollout.py --small --sides ours --lora_r 16 --merge_adapters false   # LoRA through peft
    python benchmarks/rollout.py --small --backend decode_loop    # ours through the decode-loop backend
    python benchmarks/rollout.py --small --backend decode_loop --cache dynamic --drop_finished false

The episode set: ``--tasks`` synthetic long-context tasks, each repeated ``--group`` times (a GRPO
group), each context cut into ``--chunks`` chunks of ``--chunk_tokens`` tokens; MemAgent's turns
(read a chunk, overwrite a memory of at most ``--memory_tokens`` tokens, answer in at most
``--answer_tokens`` tokens) with the default MemAgent templates.

* batched (ours): ``MemAgentWorkflow.rollout`` through ``RolloutEngine``: every turn is one
  batched generation over all conversations still running.
* naive: what MemFactory does: each trajectory on its own and each of its conversations by a
  plain ``model.generate`` of batch 1, with the same prompts (built by the workflow's own
  ``encode_prompt``, templates and ``TextMemoryStore``), the same sampling settings and caps, and
  the same per-token log-probs returned.

Each side runs in its own process (``torch.set_num_threads(--threads)``, same seed, same weights)
after one short warm-up generation. Reported per side: wall time, generated tokens and tokens/s,
conversations, prompt tokens (sum of prompt lengths), the positions the model actually processed
(counted at its input embedding: prefill and decode, padding included) and peak RSS; the ratio is
ours / naive. Generated lengths differ between the sides (sampling), so tokens/s is the measure.
Weights are float32 unless ``--dtype bfloat16`` (or ``auto`` on a CPU with bf16 hardware), the same
on both sides; ``--lora_r`` adds fresh LoRA adapters (alpha 2r, every linear layer; B starts at zero,
so the sampled tokens match the full-weight run's) that ours samples on the engine's default path
(merged weights over an fp32 base, low-rank stand-ins over a bf16 one), merged in bf16 too with
``--merge_adapters true``, through peft with ``--merge_adapters false``; ours runs its linear layers
on oneDNN-packed weights unless ``--pack_weights false``. ``--backend decode_loop`` runs ours through
``DecodeLoopEngine`` (its own decode loop; ``--cache`` and ``--drop_finished`` are its options) instead of
``RolloutEngine`` (``model.generate``). Writes ``benchmarks/results/rollout_<model>.json`` (``_small``, ``_<tag>``,
``_lora<r>``, ``_merged``, ``_unmerged``, ``_decode_loop...`` added to the name).
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
import torch

from lightning_memrl import (
    GenerationSettings,
    LoraSettings,
    MemAgentWorkflow,
    RolloutEngine,
    SyntheticTaskSettings,
    Task,
    TextMemoryStore,
    Trajectory,
    Turn,
    generate_synthetic_tasks,
)
from lightning_memrl.models import load_policy, load_tokenizer
from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation
from lightning_memrl.workflows.base import split_context

SMALL = {"tasks": 2, "group": 4, "chunks": 3, "chunk_tokens": 256, "memory_tokens": 64}
EPISODE_KEYS = ["tasks", "group", "chunks", "chunk_tokens", "memory_tokens", "answer_tokens", "temperature", "top_p"]
EPISODE_KEYS += ["top_k", "dtype", "lora_r", "merge_adapters", "pack_weights", "fold_decode_attention", "backend"]
EPISODE_KEYS += ["cache", "drop_finished"]
EPISODE_KEYS += ["threads", "seed"]  # with threads and seed: a worker's
LABELS = {
    "wall_s": "wall time (s)",
    "generated_tokens": "generated tokens",
    "tokens_per_s": "**generated tokens/s**",
    "conversations": "conversations",
    "prompt_tokens": "prompt tokens",
    "model_prefill_positions": "prefill positions processed",
    "model_decode_positions": "decode positions processed",
    "model_forward_calls": "model forward calls",
    "mean_memory_tokens": "mean memory-turn length",
    "truncated_fraction": "turns hitting the cap",
    "peak_rss_mib": "peak RSS (MiB)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder, or tiny")
    parser.add_argument("--tasks", type=int, default=4, help="distinct tasks")
    parser.add_argument("--group", type=int, default=8, help="trajectories per task")
    parser.add_argument("--chunks", type=int, default=6, help="chunks per context")
    parser.add_argument("--chunk_tokens", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--memory_tokens", type=int, default=128, help="memory budget (cap of a memory turn)")
    parser.add_argument("--answer_tokens", type=int, default=32, help="cap of the answer turn")
    parser.add_argument("--small", action="store_true", help=f"quick run: {SMALL}")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (both sides)")
    parser.add_argument("--top_p", type=float, default=0.95, help="nucleus mass (both sides)")
    parser.add_argument("--top_k", type=int, default=0, help="top-k (0 = off, both sides)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="weights, both sides")
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA adapters of rank r (alpha 2r) on both sides")
    parser.add_argument(
        "--merge_adapters",
        default="auto",
        choices=["auto", "true", "false"],
        help="ours with LoRA: auto = the engine's default (merged fp32 bases, low-rank stand-ins over bf16 ones), "
        "true = merge bf16 bases too, false = through peft",
    )
    parser.add_argument(
        "--backend", default="generate", choices=["generate", "decode_loop"], help="ours: generate or DecodeLoopEngine"
    )
    parser.add_argument(
        "--pack_weights", default="true", choices=["true", "false"], help="ours: linear layers on oneDNN-packed weights"
    )
    parser.add_argument(
        "--fold_decode_attention",
        default="true",
        choices=["true", "false"],
        help="ours: bf16/fp16 decode-step attention with query heads folded into rows (CPU)",
    )
    parser.add_argument("--cache", default="static", choices=["static", "dynamic"], help="decode_loop: its KV cache")
    parser.add_argument("--drop_finished", default="true", choices=["true", "false"], help="decode_loop: drop EOS rows")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of each side")
    parser.add_argument("--seed", type=int, default=0, help="task and sampling seed")
    parser.add_argument("--sides", default="ours,naive", help="comma-separated sides to run: ours, naive")
    parser.add_argument("--tag", default="", help="added to the result file's name (e.g. quickstart)")
    parser.add_argument("--worker", choices=["ours", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--model_path", help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small and not args.worker:
        for key, value in SMALL.items():
            setattr(args, key, value)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if bu.cpu_bf16_supported() else "float32"
    return args


def build_tasks(args: argparse.Namespace, tokenizer: Any, workflow: Any) -> list[Any]:
    """``--tasks`` synthetic tasks whose contexts are exactly ``--chunks`` chunks of ``--chunk_tokens`` tokens."""
    need = args.chunks * args.chunk_tokens
    pieces = args.chunks  # synthetic chunks of 12 filler sentences each, joined and re-cut below
    while True:
        config = SyntheticTaskSettings(
            num_tasks=args.tasks,
            min_chunks=pieces,
            max_chunks=pieces,
            sentences_per_chunk=12,
            distractor_facts=3,
            seed=args.seed,
        )
        tasks = generate_synthetic_tasks(config)
        texts = [" ".join(t.context) for t in tasks]
        if min(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts) >= need:
            break
        pieces *= 2
    return [
        Task(t.question, split_context(text, tokenizer, workflow.chunk_tokens)[: args.chunks], t.answers, t.id)
        for t, text in zip(tasks, texts)
    ]


class PositionCounter:
    """Counts the positions (batch x length, padding included) that reach a model's input embedding."""

    def __init__(self, model: Any) -> None:
        self.prefill = self.decode = self.calls = 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, inputs: tuple) -> None:
        batch, length = inputs[0].shape[:2]
        self.calls += 1
        if length > 1:
            self.prefill += batch * length
        else:
            self.decode += batch


def naive_generate(model: Any, prompt: list[int], settings: Any, max_new_tokens: int, eos: list[int]) -> Any:
    """One conversation by ``model.generate`` on a batch of 1, cut at EOS, with its token log-probs."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        pad_token_id=eos[0],
        eos_token_id=eos,
        return_dict_in_generate=True,
        output_logits=True,
        use_cache=True,
    )
    new_ids = out.sequences[0, len(prompt) :]
    logits = torch.stack(out.logits, dim=1)[0].float() / settings.temperature  # [S, V]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
    tokens = new_ids.tolist()
    ends = [i for i, t in enumerate(tokens) if t in eos]
    n = ends[0] + 1 if ends else len(tokens)
    return Generation(tokens[:n], logprobs[:n].clone(), not ends)


def naive_rollout(model: Any, tokenizer: Any, workflow: Any, tasks: list[Any], settings: Any) -> list[Any]:
    """Each trajectory alone, each conversation alone: MemAgent's turns with batch-1 generation."""
    eos = model.generation_config.eos_token_id
    eos = sorted(set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id})
    trajectories = []
    for task in tasks:
        memory = TextMemoryStore(workflow.memory.max_memory_tokens, empty_text=workflow.memory.empty_text)
        memory.reset(1)
        trajectory = Trajectory(task=task, chunks=list(task.context))
        for chunk in trajectory.chunks:
            text = workflow.memory_template.format(problem=task.question, chunk=chunk, memory=memory.read(0))
            prompt = workflow.encode_prompt(text, tokenizer)
            gen = naive_generate(model, prompt, settings, memory.max_memory_tokens, eos)
            trajectory.turns.append(Turn(MEMORY_TURN, prompt, gen, memory.write(0, gen.token_ids, tokenizer)))
        text = workflow.answer_template.format(problem=task.question, memory=memory.read(0))
        prompt = workflow.encode_prompt(text, tokenizer)
        gen = naive_generate(model, prompt, settings, settings.max_new_tokens, eos)
        trajectory.turns.append(
            Turn(ANSWER_TURN, prompt, gen, tokenizer.decode(gen.token_ids, skip_special_tokens=True))
        )
        trajectories.append(trajectory)
    return trajectories


def build_engine(args: argparse.Namespace, model: Any, tokenizer: Any) -> RolloutEngine:
    """Ours: ``RolloutEngine`` (``model.generate``) or, with ``--backend decode_loop``, ``DecodeLoopEngine``."""
    merge = {"auto": None, "true": True, "false": False}[args.merge_adapters]
    common = {
        "merge_adapters": merge,
        "pack_weights": args.pack_weights == "true",
        "fold_decode_attention": args.fold_decode_attention == "true",
    }
    if args.backend == "generate":
        return RolloutEngine(model, tokenizer, **common)
    options = {"cache": args.cache, "drop_finished": args.drop_finished == "true"}
    return DecodeLoopEngine(model, tokenizer, **common, **options)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run one side on the episode set and measure it."""
    bu.set_threads(args.threads)
    tokenizer = load_tokenizer(args.model_path)
    lora = LoraSettings(r=args.lora_r, alpha=2 * args.lora_r) if args.lora_r else None
    model = load_policy(args.model_path, tokenizer, dtype=args.dtype, lora=lora).eval()
    model.config.use_cache = True
    workflow = MemAgentWorkflow(
        max_memory_tokens=args.memory_tokens, chunk_tokens=args.chunk_tokens, max_chunks=args.chunks
    )
    tasks = build_tasks(args, tokenizer, workflow)
    episodes = [task for task in tasks for _ in range(args.group)]  # a group shares its Task, as in training
    settings = GenerationSettings(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.answer_tokens
    )
    engine = build_engine(args, model, tokenizer)
    warm = workflow.encode_prompt("Warm-up.", tokenizer)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        engine.generate([warm], settings, max_new_tokens=4)
        engine.sync_weights(model)  # as after an optimizer step: with LoRA the timed rollout merges once
        counter = PositionCounter(model)
        start = time.perf_counter()
        if args.worker == "ours":
            trajectories = workflow.rollout(engine, episodes, settings)
        else:
            trajectories = naive_rollout(model, tokenizer, workflow, episodes, settings)
        wall = time.perf_counter() - start
        counter.handle.remove()
    turns = [turn for t in trajectories for turn in t.turns]
    generated = sum(len(turn.generation.token_ids) for turn in turns)
    memory_turns = [turn for turn in turns if turn.kind == "memory"]
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "conversations": len(turns),
        "prompt_tokens": sum(len(turn.prompt_ids) for turn in turns),
        "model_prefill_positions": counter.prefill,
        "model_decode_positions": counter.decode,
        "model_forward_calls": counter.calls,
        "mean_memory_tokens": sum(len(t.generation.token_ids) for t in memory_turns) / max(len(memory_turns), 1),
        "truncated_fraction": sum(t.generation.truncated for t in turns) / len(turns),
        "chunk_tokens_actual": [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in tasks[0].context],
        "peak_rss_mib": bu.peak_rss_mib(),
        "fallbacks": getattr(engine, "fallbacks", {}),  # decode_loop: calls run through model.generate
    }


def run_sides(args: argparse.Namespace, sides: list[str]) -> dict[str, dict[str, Any]]:
    """Each side's worker result, every side on the same model folder and episode set."""
    common = [f"--{k}={getattr(args, k)}" for k in EPISODE_KEYS]
    with tempfile.TemporaryDirectory() as tmp:
        path = bu.resolve_model(args.model, Path(tmp))
        worker_args = {side: [*common, "--worker", side, "--model_path", path] for side in sides}
        return {side: bu.run_worker(__file__, worker_args[side], side) for side in sides}


def ours_over_naive(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ratios ours / naive of throughput, wall time and positions processed (empty with one side)."""
    if len(results) != 2:
        return {}
    return {
        k: bu.ratio(results["ours"][k], results["naive"][k])
        for k in ("tokens_per_s", "wall_s", "model_prefill_positions", "model_decode_positions")
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(args)))
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"ours", "naive"}:
        raise SystemExit(f"--sides: use 'ours', 'naive' or 'ours,naive', got {args.sides!r}")
    results = run_sides(args, sides)
    ratios = ours_over_naive(results)
    names = {"ours": "ours (batched)", "naive": "naive loop"}
    headers, rows = bu.comparison_table(LABELS, results, sides, ratios, names, "ours / naive")
    tag = bu.model_tag(args.model) + ("_small" if args.small else "") + (f"_{args.tag}" if args.tag else "")
    if args.backend == "decode_loop":
        tag += f"_decode_loop_{args.cache}"
        tag += "" if args.drop_finished == "true" else "_keep_finished"
    if args.lora_r:
        tag += f"_lora{args.lora_r}" + {"auto": "", "true": "_merged", "false": "_unmerged"}[args.merge_adapters]
    tag += "" if args.pack_weights == "true" else "_unpacked"
    tag += "" if args.fold_decode_attention == "true" else "_unfolded"
    command = "python benchmarks/rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": command.strip(),
        "machine": bu.machine(args.threads),
        "model": args.model,
        "episodes": {k: getattr(args, k) for k in EPISODE_KEYS if k not in ("threads", "seed")},
        "sides": results,
        "ratio_ours_over_naive": ratios,
    }
    out = bu.write_result(f"rollout_{tag}", result)
    print(
        f"MemAgent rollout on {args.model}: {args.tasks} tasks x group {args.group} x {args.chunks} chunks of "
        f"{args.chunk_tokens} tokens, memory {args.memory_tokens}, answer {args.answer_tokens}, T={args.temperature}, "
        f"top_p={args.top_p}, {args.dtype}, {args.threads} threads"
    )
    print()
    print(bu.markdown_table(headers, rows))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
