"""The update's forward and backward through LoRA layers over a bf16 base: peft's layers against grouped ones.

    python benchmarks/lora_update.py                      # SmolLM2-135M-Instruct, LoRA r 16, 5 rows x 400 tokens
    python benchmarks/lora_update.py --model tiny --rows 2 --tokens 16 --repeats 1   # seconds

Times one forward and backward of the policy's decoder (random token ids, a loss on the last hidden
states, no LM head) with the adapters as peft runs them and inside ``lightning_memrl.adapter_groups.grouped``
(what the module's update uses), alternating the two ``--repeats`` times, and sums the bytes of the
tensors autograd keeps for backward (``saved_tensors_hooks``), fp32 ones apart. The work is the same on
both sides, so unlike a training step's time it does not move with what the rollouts sampled. Writes
``benchmarks/results/lora_update_<model>[_<tag>].json`` with the machine (CPU flags included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils as bu  # noqa: E402

from lightning_memrl import LoraSettings, adapter_groups  # noqa: E402
from lightning_memrl.models import load_policy, load_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="hub id, folder, or tiny")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (lora_alpha 2r, every linear layer)")
    parser.add_argument("--rows", type=int, default=5, help="sequences in the batch")
    parser.add_argument("--tokens", type=int, default=400, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two sides (median taken)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. the machine kind)")
    return parser.parse_args(argv)


def forward_backward(model: Any, ids: torch.Tensor) -> tuple[float, dict[str, int]]:
    """Seconds of one forward and backward of the decoder, and the bytes autograd kept for it."""
    kept = {"bytes": 0, "fp32_bytes": 0}
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in seen:  # a tensor kept twice is held once
            seen.add(tensor.untyped_storage().data_ptr())
            size = tensor.untyped_storage().nbytes()
            kept["bytes"] += size
            kept["fp32_bytes"] += size if tensor.dtype == torch.float32 else 0
        return tensor

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = model.get_base_model().model(input_ids=ids).last_hidden_state
        loss = hidden.float().pow(2).mean()
    loss.backward()
    return time.perf_counter() - start, kept


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    bu.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = bu.resolve_model(args.model, Path(tmp))
        tokenizer = load_tokenizer(path)
        lora = LoraSettings(r=args.lora_r, lora_alpha=2 * args.lora_r, init_lora_weights="gaussian")
        model = load_policy(path, tokenizer, dtype="bfloat16", lora=lora).train()
    ids = torch.randint(0, model.get_input_embeddings().weight.shape[0], (args.rows, args.tokens))
    sides: dict[str, dict[str, Any]] = {"peft": {"s": []}, "grouped": {"s": []}}
    for side in sides:  # warm-up, and the memory each side keeps
        with adapter_groups.grouped(model) if side == "grouped" else nullcontext():
            _, sides[side]["kept"] = forward_backward(model, ids)
    for _ in range(args.repeats):
        for side, row in sides.items():
            with adapter_groups.grouped(model) if side == "grouped" else nullcontext():
                row["s"].append(forward_backward(model, ids)[0])
    for row in sides.values():
        row["median_s"] = statistics.median(row["s"])
    result = {
        "command": "python benchmarks/lora_update.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": bu.machine(args.threads),
        "work": {k: getattr(args, k) for k in ("model", "lora_r", "rows", "tokens", "repeats")},
        "sides": sides,
        "grouped_over_peft": sides["grouped"]["median_s"] / sides["peft"]["median_s"],
    }
    name = bu.tagged(f"lora_update_{bu.model_tag(args.model)}", args.tag)
    print(
        bu.markdown_table(
            ["", "peft", "grouped"],
            [
                ["forward + backward (s, median)", *[sides[s]["median_s"] for s in sides]],
                ["kept for backward (MiB)", *[sides[s]["kept"]["bytes"] / 2**20 for s in sides]],
                ["of it fp32 (MiB)", *[sides[s]["kept"]["fp32_bytes"] / 2**20 for s in sides]],
            ],
        )
    )
    print(f"wrote {bu.write_result(name, result)}")
    return result


if __name__ == "__main__":
    main()
