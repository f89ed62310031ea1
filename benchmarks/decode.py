"""Decode speed against the hardware: the weight-streaming floor, a bare decode step, our engine's decode step.

    python benchmarks/decode.py                          # SmolLM2-135M-Instruct, bf16 and fp32, batch 8
    python benchmarks/decode.py --threads 1 --lora_r 16  # also a LoRA model: the default path and peft
    python benchmarks/decode.py --model tiny --steps 4 --repeats 1 --bandwidth_mib 64   # seconds
    python benchmarks/decode.py --compile               # also the decode loop's step under torch.compile

Per weight dtype (``--dtypes``), at batch ``--batch`` after a prompt of ``--prompt_tokens`` random tokens:

* floor: the bytes of the weights (every parameter once: a tied embedding is read once, by the LM
  head) over the memory read bandwidth measured here (the sum of a ``--bandwidth_mib`` fp32
  tensor, the fastest of 10 sums, read before and after the timings and the faster taken, same threads): a
  decode step that only streamed its weights once.
* bare: one ``model(input_ids [B, 1], cache=cache)`` with the KV cache of the prompt,
  greedy next token; the median of ``--steps`` steps.
* engine: ``RolloutEngine.generate`` (sampling at T=1, log-probs of the sampled tokens, generate's
  per-token work): the time of ``--steps`` + 1 new tokens minus the time of 1 new token (same
  prefill), over the decode forwards counted at the input embedding; median of ``--repeats``.
* engine unfolded / unpacked: the engine with ``fold_decode_attention: false`` (bf16/fp16 decode
  attention through ``sdpa`` as loaded) / with ``pack_weights: false``; reserved / unreserved: with
  ``reserve_kv_cache: true`` (the default) / ``false`` (``generate``'s concatenating cache).
* loop: the decode-loop backend (``DecodeLoopEngine``), timed as the engine, with its static cache and with
  the dynamic one; with ``--compile`` also its ``torch.compile``-d step over plain layers (static cache
  rounded up to 64 columns): the warm-up (the first call's time minus the same call's once compiled) and the
  step after it.
* with ``--lora_r``: the engine over the same weights with LoRA adapters (alpha 2r, every linear
  layer) on its default LoRA path (merged weights over an fp32 base, low-rank stand-ins over a bf16
  one: ``lightning_memrl.rollout.merged``) and through peft's layers (``merge_adapters: false``).

Ratios: bare / floor, engine / floor, engine / bare. Writes ``benchmarks/results/decode_<model>[_<tag>].json``
with the machine (CPU flags included). Timings on a CPU other jobs share are not comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_utils as bu
import torch

from lightning_memrl import GenerationSettings, LoraSettings, RolloutEngine
from lightning_memrl.models import load_policy, load_tokenizer
from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
from lightning_memrl.rollout.packed import PackedLinears

WORK_KEYS = ("batch", "prompt_tokens", "steps", "repeats", "lora_r", "compile", "seed")
LABELS = {
    "weights_mib": "weights (MiB)",
    "floor_ms": "weight-streaming floor (ms)",
    "bare_ms": "bare `model(...)` decode step (ms)",
    "engine_ms": "**our engine's decode step (ms)**",
    "loop_static_ms": "decode-loop backend, static cache (ms)",
    "loop_dynamic_ms": "decode-loop backend, dynamic cache (ms)",
    "loop_compiled_ms": "decode-loop backend, compiled step, plain layers (ms)",
    "loop_compiled_warmup_s": "its compile warm-up, first call (s)",
    "bare_packed_ms": "bare step, oneDNN-packed weights (ms)",
    "engine_unpacked_ms": "our engine, weights not packed (`pack_weights: false`) (ms)",
    "engine_unfolded_ms": "our engine, decode attention not folded (`fold_decode_attention: false`) (ms)",
    "engine_reserved_ms": "our engine, reserved KV cache (`reserve_kv_cache: true`) (ms)",
    "engine_unreserved_ms": "our engine, generate's own KV cache (`reserve_kv_cache: false`) (ms)",
    "pack_s": "packing the weights, once per rollout (s)",
    "engine_lora_ms": "engine, LoRA: merged (fp32) or low-rank stand-ins (bf16) (ms)",
    "engine_lora_peft_ms": "engine, LoRA through peft (ms)",
    "bare_over_floor": "bare / floor",
    "engine_over_floor": "engine / floor",
    "engine_over_bare": "engine / bare",
    "loop_over_floor": "decode loop (static) / floor",
    "loop_over_engine": "decode loop (static) / engine",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder, or tiny")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated weight dtypes")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--prompt_tokens", type=int, default=64, help="prompt length before decoding")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3, help="engine timings (median)")
    parser.add_argument("--bandwidth_mib", type=int, default=512, help="size of the tensor summed for bandwidth")
    parser.add_argument("--lora_r", type=int, default=0, help="also time the engine over LoRA (rank r); 0: not")
    parser.add_argument("--compile", action="store_true", help="also time the decode loop's compiled step")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. the machine kind)")
    args = parser.parse_args(argv)
    if min(args.batch, args.prompt_tokens, args.steps, args.repeats, args.bandwidth_mib) < 1:
        parser.error("--batch, --prompt_tokens, --steps, --repeats and --bandwidth_mib must be >= 1")
    return args


def read_bandwidth_gbs(mib: int) -> float:
    """Memory read bandwidth in GB/s: bytes of a ``mib`` MiB fp32 tensor over the fastest of 10 sums."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # pages touched, threads started
    best = min(_timed(x.sum) for _ in range(10))
    return x.numel() * 4 / best / 1e9


def _timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every parameter and buffer once (shared tensors counted once)."""
    return round(bu.param_mib(model) * 2**20)


@torch.no_grad()
def bare_decode_ms(model: Any, prompts: torch.Tensor, steps: int) -> float:
    """Median milliseconds of one ``model(...)`` decode step with the prompt's KV cache, greedy tokens."""
    out = model(input_ids=prompts, use_cache=True)
    cache, times = out.past_key_values, []
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps + 1):  # the first step is warm-up
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


class DecodeCounter:
    """Counts the forwards of one new position (decode steps) at a model's input embedding."""

    def __init__(self, model: Any) -> None:
        self.decodes = 0
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, inputs: tuple) -> None:
        self.decodes += int(inputs[0].shape[1] == 1)


def engine_decode_ms(engine: RolloutEngine, prompts: list[list[int]], steps: int, repeats: int) -> float:
    """Milliseconds per decode step of ``engine.generate``: (steps + 1 new tokens minus 1 new token) per decode."""
    settings = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=steps + 1)
    engine.generate(prompts, settings)  # warm-up: packing, and every shape the timed calls meet
    counter, per_step = DecodeCounter(engine.model), []
    try:
        for _ in range(repeats):
            one = _timed(engine.generate, prompts, settings, max_new_tokens=1)
            counter.decodes = 0
            many = _timed(engine.generate, prompts, settings)
            per_step.append((many - one) / max(counter.decodes, 1))
    finally:
        counter.handle.remove()
    return statistics.median(per_step) * 1e3


def loop_rows(model: Any, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """The decode-loop backend's step: static and dynamic cache, and with ``--compile`` the compiled step."""
    row = {}
    for cache in ("static", "dynamic"):
        engine = DecodeLoopEngine(model, tokenizer, cache=cache)
        row[f"loop_{cache}_ms"] = engine_decode_ms(engine, prompts, args.steps, args.repeats)
    if args.compile:
        row.update(compiled_loop_rows(model, tokenizer, prompts, args))
    return row


class BucketedLoop(DecodeLoopEngine):
    """The decode loop with one static cache per length, rounded up to a multiple of 64 columns and reset between
    calls, so that calls share one compiled step (the compiled code is guarded on the cache's tensors: with
    ``dynamic=False`` a new cache or length compiles anew)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.caches: dict[int, Any] = {}

    def _cache_len(self, width: int, max_new_tokens: int) -> int:
        return -(-(width + max_new_tokens) // 64) * 64

    def _new_cache(self, length: int) -> Any:
        if length not in self.caches:
            self.caches[length] = super()._new_cache(length)
        self.caches[length].reset()
        return self.caches[length]


def compiled_loop_rows(model: Any, tokenizer: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The decode loop's step under ``torch.compile`` (inductor, static shapes) and the warm-up it costs.

    Inductor cannot lower oneDNN-packed weights or the folded attention, so the compiled step runs over the
    plain layers (``pack_weights: false``, ``fold_decode_attention: false``). Inductor's ``freezing`` (weights
    prepacked as constants) is not timed: it would sample from stale weights after an optimizer step, and with
    ``transformers``' ``StaticCache`` its compiled step aborted with an out-of-bounds cache index on the second
    call (torch 2.13). The decode loop stops early only when every row has emitted EOS (``drop_finished: false``),
    so a call of ``steps + 1`` new tokens runs ``steps`` decode forwards.
    """
    torch._dynamo.reset()
    engine = BucketedLoop(
        model, tokenizer, cache="static", drop_finished=False, pack_weights=False, fold_decode_attention=False
    )
    engine._step = torch.compile(engine._step, dynamic=False)  # the backend has no such option: measured here
    settings = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.steps + 1)
    with tempfile.TemporaryDirectory() as cache_dir, _environ(TORCHINDUCTOR_CACHE_DIR=cache_dir):  # a cold compile
        first = _timed(engine.generate, prompts, settings)
        per_step = []
        for _ in range(args.repeats):  # no DecodeCounter: a forward hook makes the compiled step recompile
            many = _timed(engine.generate, prompts, settings)
            per_step.append((many - _timed(engine.generate, prompts, settings, max_new_tokens=1)) / args.steps)
    torch._dynamo.reset()
    return {"loop_compiled_warmup_s": first - many, "loop_compiled_ms": statistics.median(per_step) * 1e3}


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def time_dtype(args: argparse.Namespace, path: str, dtype: str) -> dict[str, Any]:
    """The floor, the bare step and the engine's step (and its LoRA variants) for one weight dtype."""
    tokenizer = load_tokenizer(path)
    model = load_policy(path, tokenizer, dtype=dtype).eval()
    model.config.use_cache = True
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=generator)
    torch.manual_seed(args.seed)
    row = {"weights_mib": weight_bytes(model) / 2**20}
    row["bare_ms"] = bare_decode_ms(model, prompts, args.steps)
    packed = PackedLinears(model)
    start = time.perf_counter()
    with packed.swapped():
        row["pack_s"] = time.perf_counter() - start
        row["bare_packed_ms"] = bare_decode_ms(model, prompts, args.steps)
    packed.release()
    engine_decode_ms(RolloutEngine(model, tokenizer), prompts.tolist(), args.steps, 1)  # discarded: the first
    # engine timed in a process ran 10-40% slow (50.1 against 35.8 ms for the same engine later in one run)
    row["engine_ms"] = engine_decode_ms(RolloutEngine(model, tokenizer), prompts.tolist(), args.steps, args.repeats)
    unpacked = RolloutEngine(model, tokenizer, pack_weights=False)
    row["engine_unpacked_ms"] = engine_decode_ms(unpacked, prompts.tolist(), args.steps, args.repeats)
    unfolded = RolloutEngine(model, tokenizer, fold_decode_attention=False)
    row["engine_unfolded_ms"] = engine_decode_ms(unfolded, prompts.tolist(), args.steps, args.repeats)
    for key, reserve in (("engine_reserved_ms", True), ("engine_unreserved_ms", False)):
        engine = RolloutEngine(model, tokenizer, reserve_kv_cache=reserve)
        row[key] = engine_decode_ms(engine, prompts.tolist(), args.steps, args.repeats)
    row.update(loop_rows(model, tokenizer, prompts.tolist(), args))
    del model
    if args.lora_r:
        lora = LoraSettings(r=args.lora_r, alpha=2 * args.lora_r)
        adapted = load_policy(path, tokenizer, dtype=dtype, lora=lora).eval()
        adapted.config.use_cache = True
        for key, merge in (("engine_lora_ms", None), ("engine_lora_peft_ms", False)):
            engine = RolloutEngine(adapted, tokenizer, merge_adapters=merge)
            row[key] = engine_decode_ms(engine, prompts.tolist(), args.steps, args.repeats)
            if engine.merged:
                row["lora_copies_mib"] = engine.merged.merged_mib
    row["engine_over_bare"] = row["engine_ms"] / row["bare_ms"]
    row["packed_over_unpacked"] = row["engine_ms"] / row["engine_unpacked_ms"]
    row["folded_over_unfolded"] = row["engine_ms"] / row["engine_unfolded_ms"]
    row["reserved_over_unreserved"] = row["engine_reserved_ms"] / row["engine_unreserved_ms"]
    row["loop_over_engine"] = row["loop_static_ms"] / row["engine_ms"]
    return row


def add_floor(row: dict[str, Any], bandwidth: float) -> None:
    """The weight-streaming floor at ``bandwidth`` (bytes/s) and each step's ratio to it."""
    row["floor_ms"] = row["weights_mib"] * 2**20 / bandwidth * 1e3
    row["bare_over_floor"] = row["bare_ms"] / row["floor_ms"]
    row["engine_over_floor"] = row["engine_ms"] / row["floor_ms"]
    row["loop_over_floor"] = row["loop_static_ms"] / row["floor_ms"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    bu.set_threads(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    before = read_bandwidth_gbs(args.bandwidth_mib) * 1e9
    with tempfile.TemporaryDirectory() as tmp:
        path = bu.resolve_model(args.model, Path(tmp))
        rows = {dtype: time_dtype(args, path, dtype) for dtype in dtypes}
    bandwidth = max(before, read_bandwidth_gbs(args.bandwidth_mib) * 1e9)  # the machine's: the faster reading
    for row in rows.values():
        add_floor(row, bandwidth)
    command = "python benchmarks/decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": command.strip(),
        "machine": bu.machine(args.threads),
        "model": args.model,
        "work": {k: getattr(args, k) for k in WORK_KEYS},
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_readings_gb_s": [before / 1e9, bandwidth / 1e9] if bandwidth != before else [before / 1e9],
        "bandwidth_tensor_mib": args.bandwidth_mib,
        "dtypes": rows,
    }
    out = bu.write_result(bu.tagged(f"decode_{bu.model_tag(args.model)}", args.tag), result)
    print(
        f"Decode on {args.model}: batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.steps} steps, "
        f"{args.threads} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s\n"
    )
    labels = {k: v for k, v in LABELS.items() if any(k in row for row in rows.values())}
    table = [[label, *[rows[d].get(key, float("nan")) for d in dtypes]] for key, label in labels.items()]
    print(bu.markdown_table(["", *dtypes], table))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
