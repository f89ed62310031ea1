"""The tensor-level half of ``memory_profile.py``: one training step under ``torch.profiler`` with
``profile_memory``, summarised as the live tensor bytes by category at the step's peak, the largest
tensors alive then, and the operators that allocated the most memory (net of what they freed).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import bench_utils as bu

MIB = 2**20


class ProfileOneStep:
    """A Lightning callback that runs the profiler over training batch ``index`` only."""

    def __new__(cls, prof: Any, index: int) -> Any:
        import lightning as L

        class _OneStep(L.Callback):
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == index:
                    prof.start()

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == index:
                    prof.stop()

        return _OneStep()


def profiled_call(fn: Callable[..., Any], prof: Any, index: int) -> Callable[..., Any]:
    """``fn`` with the profiler running around its call number ``index`` (0-based) only."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        profiling, calls[0] = calls[0] == index, calls[0] + 1
        if not profiling:
            return fn(*args, **kwargs)
        prof.start()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.stop()

    return wrapped


def live_at_peak(memory_profile: Any, top: int) -> dict[str, Any]:
    """Bytes by category at the moment the most tensor memory was alive, and the largest tensors then."""
    from torch.profiler._memory_profiler import Action, TensorKey

    def category(key: Any, version: int) -> str:
        found = memory_profile._categories.get(key, version) if isinstance(key, TensorKey) else None
        return found.name.lower() if found is not None else "unknown"

    events = [e for e in memory_profile.timeline if e[2][0].device.type == "cpu"]

    def replay(stop: int) -> tuple[dict[Any, tuple[int, str]], int]:
        """Live tensors after the first ``stop`` events, and the event index of the largest total."""
        live: dict[Any, tuple[int, str]] = {}
        total, peak, peak_at = 0, -1, 0
        for i, (_, action, (key, version), numbytes) in enumerate(events[:stop]):
            if action in (Action.PREEXISTING, Action.CREATE):
                live[key] = (numbytes, category(key, version))
                total += numbytes
            elif action == Action.INCREMENT_VERSION and key in live:
                live[key] = (live[key][0], category(key, version + 1))
            elif action == Action.DESTROY and key in live:
                total -= live.pop(key)[0]
            if total > peak:
                peak, peak_at = total, i + 1
        return live, peak_at

    _, peak_at = replay(len(events))
    peak_live, _ = replay(peak_at)
    peak = sum(n for n, _ in peak_live.values())
    by_category: dict[str, float] = {}
    for numbytes, cat in peak_live.values():
        by_category[cat] = by_category.get(cat, 0.0) + numbytes / MIB
    largest = sorted(peak_live.values(), key=lambda item: -item[0])[:top]
    return {
        "peak_tensor_mib": peak / MIB,
        "by_category_mib": dict(sorted(by_category.items(), key=lambda item: -item[1])),
        "largest_tensors": [{"mib": n / MIB, "category": c} for n, c in largest],
    }


def top_operators(prof: Any, top: int) -> list[dict[str, Any]]:
    """Operators (with input shapes) by the memory they allocated and did not free themselves."""
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_cpu_memory_usage > 0]
    rows.sort(key=lambda e: -e.self_cpu_memory_usage)
    return [
        {
            "op": e.key,
            "input_shapes": str(e.input_shapes)[:160],
            "calls": e.count,
            "net_alloc_mib": e.self_cpu_memory_usage / MIB,
        }
        for e in rows[:top]
    ]


def worker_torch_profile(args: argparse.Namespace, build: Callable[..., tuple[Any, Any, Any]]) -> dict[str, Any]:
    """Profile the update (or, with ``--profile_phase step``, the whole) of training step ``args.warmup`` (0-based)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    bu.set_threads(args.threads)
    module, data, trainer = build(args.config, args.overrides, args.warmup + 1)
    module.configure_model()
    # torch's category analysis (``_memory_profile``) needs Python stacks; over a whole quickstart step
    # they outgrew 24 GiB of RAM, so a whole step gets the operator list only.
    stacks = args.profile_phase == "update"
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=stacks)
    if args.profile_phase == "step":
        trainer.callbacks.append(ProfileOneStep(prof, args.warmup))
    else:
        module.update = profiled_call(module.update, prof, args.warmup)
    torch.manual_seed(0)
    trainer.fit(module, data)
    result = {"profiled_step": args.warmup, "phase": args.profile_phase, "operators": top_operators(prof, args.top)}
    if not stacks:
        result["live_at_peak_error"] = "not computed for --profile_phase step (needs stacks: too much memory)"
        return result
    try:
        result.update(live_at_peak(prof._memory_profile(), args.top))
    except Exception as err:  # a private torch API: the operator list above still stands
        result["live_at_peak_error"] = repr(err)
    return result


def profile_report(profile: dict[str, Any]) -> str:
    """Markdown of a torch-profile result: categories at the peak, largest tensors, top operators."""
    if "peak_tensor_mib" in profile:
        lines = [f"\ntensor memory at the profiled call's peak: {profile['peak_tensor_mib']:.0f} MiB"]
    else:
        lines = [f"\ntensor memory by category: not available ({profile.get('live_at_peak_error', 'not computed')})"]
    cats = profile.get("by_category_mib", {})
    if cats:
        lines += ["", bu.markdown_table(["category", "MiB"], [[k, v] for k, v in cats.items()])]
    tensors = profile.get("largest_tensors", [])
    if tensors:
        rows = [[t["mib"], t["category"]] for t in tensors]
        lines += ["", "largest tensors alive at the peak:", "", bu.markdown_table(["MiB", "category"], rows)]
    ops = [[o["op"], o["input_shapes"], o["calls"], o["net_alloc_mib"]] for o in profile["operators"]]
    lines += ["", bu.markdown_table(["operator", "input shapes", "calls", "net allocated (MiB)"], ops)]
    return "\n".join(lines)
