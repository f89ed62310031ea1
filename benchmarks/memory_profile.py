"""Where a GRPO step's memory goes: peak RSS of each phase above the post-import baseline.

    python benchmarks/memory_profile.py                                     # quickstart (SmolLM2, LoRA), 2 steps
    python benchmarks/memory_profile.py --config configs/memagent/tiny.yaml --steps 1
    python benchmarks/memory_profile.py --torch_profile                     # plus a tensor-level profile of a step
    python benchmarks/memory_profile.py --model.init_args.grpo.kl_coef=0.001   # any lightning-memrl fit option

The work runs in a fresh worker process (``bench_utils.run_worker``): it imports torch,
transformers, peft, Lightning and ``lightning_memrl`` and takes its RSS as the **post-import
baseline**, builds the module and data from ``--config`` as ``lightning-memrl fit`` does, loads the
model (phase ``load``), then runs ``--warmup`` + ``--steps`` training steps through a Lightning
``Trainer`` (no validation, no logger). Each phase of a step is timed and its peak RSS taken from
the kernel's high-water mark (``VmHWM`` of ``/proc/self/status``), reset by writing ``5`` to
``/proc/self/clear_refs`` when the phase starts (Linux): ``rollout`` (the workflow's turns),
``old_ref_logprobs`` (old and reference log-probs, no gradients), ``forward`` (the policy's
log-probs with gradients), ``backward``, ``optimizer`` (AdamW step, zero_grad, scheduler), and
``other`` (whatever runs between them: rewards, advantages, the loss, clipping). The peak of a
phase is the maximum over its calls in the measured steps.

The result is the step's peak RSS minus the post-import RSS, against the bytes of the policy's
weights (``bench_utils.param_mib``). ``--torch_profile`` adds, from a second worker, a
``torch.profiler`` (``profile_memory``) record of one step's update (old and reference log-probs,
forward, backward, optimizer; ``--profile_phase step`` adds the rollout): the live tensor bytes by
category (parameter, activation, gradient, optimizer state, temporary, ...) at the peak, the largest
tensors alive then, and the operators that allocated the most memory. The profiler keeps a record
of every allocation: a whole quickstart step (the rollout's thousands of small decode operators
included) outgrew 24 GiB of RAM, hence the update alone by default. The profiler's own book-keeping
inflates RSS, so that worker's RSS is not reported.

Writes ``benchmarks/results/memory_profile_<config>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bench_utils as bu

REPO = Path(__file__).resolve().parents[1]
PHASES = ["load", "rollout", "old_ref_logprobs", "forward", "backward", "optimizer", "other"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/memagent/quickstart.yaml", help="config to profile")
    parser.add_argument("--steps", type=int, default=2, help="measured training steps")
    parser.add_argument("--warmup", type=int, default=0, help="steps run before measuring (their peaks are left out)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--torch_profile", action="store_true", help="also a tensor-level profile of one step")
    parser.add_argument(
        "--profile_phase",
        default="update",
        choices=["update", "step"],
        help="what --torch_profile records: the update of one step (default) or the whole step",
    )
    parser.add_argument("--top", type=int, default=12, help="rows of the tensor and operator lists")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. before/after a change)")
    parser.add_argument("--worker", choices=["rss", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--worker_out", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides  # any other option goes to the config, as on the lightning-memrl command line
    return args


# --------------------------------------------------------------------------- RSS by phase
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMeter:
    """Peak RSS per phase, from the kernel's high-water mark reset at each phase boundary (Linux)."""

    def __init__(self) -> None:
        self.baseline = _status_kib("VmRSS") / 1024
        self.peaks: dict[str, float] = {}  # phase -> max peak RSS above the baseline (MiB)
        self.ends: dict[str, float] = {}  # phase -> RSS above the baseline when its last call ended (MiB)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.recording = True
        self._depth = 0
        self._reset()

    @staticmethod
    def _reset() -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def _record(self, name: str) -> None:
        peak = _status_kib("VmHWM") / 1024 - self.baseline
        if self.recording:
            self.peaks[name] = max(self.peaks.get(name, float("-inf")), peak)
            self.ends[name] = _status_kib("VmRSS") / 1024 - self.baseline
        self._reset()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure ``name``; a phase entered inside another belongs to the outer one."""
        if self._depth:
            yield
            return
        self._record("other")  # what ran since the last phase ended
        self._depth, start = 1, time.perf_counter()
        try:
            yield
        finally:
            self._depth = 0
            self._record(name)
            if self.recording:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, name: str, fn: Callable[..., Any], when: Callable[[], bool] = lambda: True) -> Callable[..., Any]:
        """``fn`` measured as phase ``name`` whenever ``when()`` holds at the call."""

        def measured(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return fn(*args, **kwargs)
            with self.phase(name):
                return fn(*args, **kwargs)

        return measured


def instrument(module: Any, meter: PeakMeter) -> None:
    """Route the step's phases of ``module`` (and of ``lightning_memrl.learner``) through ``meter``."""
    import torch

    from lightning_memrl import learner

    module.rollout = meter.wrap("rollout", module.rollout)
    module.sequence_logprobs = meter.wrap("forward", module.sequence_logprobs, torch.is_grad_enabled)
    module.manual_backward = meter.wrap("backward", module.manual_backward)
    learner.old_and_reference_logprobs = meter.wrap("old_ref_logprobs", learner.old_and_reference_logprobs)
    learner._step = meter.wrap("optimizer", learner._step)


def build(config: str, overrides: list[str], steps: int) -> tuple[Any, Any, Any]:
    """Module, data module and trainer of ``config`` as ``lightning-memrl fit`` builds them (nothing run)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_memrl.data.datamodule import MemRLDataModule
    from lightning_memrl.module import MemRLModule

    args = ["--config", config, *overrides, "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0"]
    args += ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    cli = LightningCLI(
        MemRLModule, MemRLDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args
    )
    return cli.model, cli.datamodule, cli.trainer


def malloc_trim_mib() -> float:
    """RSS glibc hands back to the system on ``malloc_trim(0)`` (freed but kept heap), in MiB; NaN without glibc."""
    from lightning_memrl import allocator

    libc = allocator.glibc()  # measured even where the user's setting turns the module's trimming off
    if libc is None:
        return float("nan")
    before = _status_kib("VmRSS")
    allocator.trim(libc)
    return (before - _status_kib("VmRSS")) / 1024


class StepGate:
    """A Lightning callback that switches the meter's recording on after the warm-up steps."""

    def __new__(cls, meter: PeakMeter, warmup: int) -> Any:
        import lightning as L

        class _Gate(L.Callback):
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                meter.recording = batch_idx >= warmup

        return _Gate()


def worker_rss(args: argparse.Namespace) -> dict[str, Any]:
    """Post-import baseline, the load's peak, and each phase's peak over the measured steps."""
    import lightning  # noqa: F401  (every import before the baseline)
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import lightning_memrl  # noqa: F401

    bu.set_threads(args.threads)
    meter = PeakMeter()
    module, data, trainer = build(args.config, args.overrides, args.warmup + args.steps)
    with meter.phase("load"):
        module.configure_model()
    instrument(module, meter)
    trainer.callbacks.append(StepGate(meter, args.warmup))
    torch.manual_seed(0)
    trainer.fit(module, data)
    meter._record("other")
    step_phases = [p for p in meter.peaks if p != "load"]
    return {
        "post_import_rss_mib": meter.baseline,
        "policy_weights_mib": bu.param_mib(module.policy),
        "trainable_mib": sum(p.numel() * p.element_size() for p in module.policy.parameters() if p.requires_grad)
        / 2**20,
        "peak_above_import_mib": {p: meter.peaks[p] for p in PHASES if p in meter.peaks},
        "end_above_import_mib": {p: meter.ends[p] for p in PHASES if p in meter.ends},
        "seconds": meter.seconds,
        "calls": meter.calls,
        "step_peak_above_import_mib": max(meter.peaks[p] for p in step_phases),
        "load_peak_above_import_mib": meter.peaks["load"],
        "malloc_trim_frees_mib": malloc_trim_mib(),
        "ru_maxrss_mib": bu.peak_rss_mib(),
    }


def worker_main(args: argparse.Namespace) -> None:
    """Run the chosen worker in a scratch folder (the config's log paths land there)."""
    config = str((REPO / args.config).resolve()) if not Path(args.config).is_absolute() else args.config
    args.config = config
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        if args.worker == "rss":
            result = worker_rss(args)
        else:
            from memory_torch_profile import worker_torch_profile

            result = worker_torch_profile(args, build)
    Path(args.worker_out).write_text(json.dumps(result))


def worker_argv(args: argparse.Namespace, worker: str) -> list[str]:
    argv = [f"--config={args.config}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    argv += [f"--threads={args.threads}", f"--top={args.top}", f"--worker={worker}"]
    argv += [f"--profile_phase={args.profile_phase}"]
    return [*argv, *args.overrides]


def report(result: dict[str, Any]) -> str:
    """The per-phase table of a result."""
    rss = result["rss"]
    weights = rss["policy_weights_mib"]
    rows = [
        [p, rss["peak_above_import_mib"][p], rss["peak_above_import_mib"][p] / weights, rss["end_above_import_mib"][p]]
        for p in PHASES
        if p in rss["peak_above_import_mib"]
    ]
    headers = ["phase", "peak RSS - post-import (MiB)", "x weights", "RSS after it (MiB)"]
    lines = [
        f"post-import RSS {rss['post_import_rss_mib']:.0f} MiB, policy weights {weights:.0f} MiB "
        f"(trainable {rss['trainable_mib']:.1f} MiB); step peak - post-import {rss['step_peak_above_import_mib']:.0f} "
        f"MiB = {result['step_peak_over_weights']:.2f}x weights; load {result['load_peak_over_weights']:.2f}x",
        "",
        bu.markdown_table(headers, rows),
    ]
    return "\n".join(lines)


def allocator_setting() -> str:
    """How the worker's allocator runs: the module's ``malloc_trim`` between phases, or the user's choice."""
    from lightning_memrl.allocator import user_choice

    return user_choice(os.environ) or "malloc_trim between phases (default)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return {}
    script = str(Path(__file__).resolve())
    result: dict[str, Any] = {
        "command": "python benchmarks/memory_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": bu.machine(args.threads),
        "config": args.config,
        "overrides": args.overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "allocator": allocator_setting(),
    }
    result["rss"] = rss = bu.run_worker(script, worker_argv(args, "rss"), "memory profile")
    result["step_peak_over_weights"] = rss["step_peak_above_import_mib"] / rss["policy_weights_mib"]
    result["load_peak_over_weights"] = rss["load_peak_above_import_mib"] / rss["policy_weights_mib"]
    if args.torch_profile:
        result["torch_profile"] = bu.run_worker(script, worker_argv(args, "torch"), "torch profile")
    name = "memory_profile_" + Path(args.config).stem + (f"_{args.tag}" if args.tag else "")
    path = bu.write_result(name, result)
    print(report(result))
    if args.torch_profile:
        from memory_torch_profile import profile_report

        print(profile_report(result["torch_profile"]))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
