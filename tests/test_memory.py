"""Memory: the per-phase RSS meter of ``benchmarks/memory_profile.py`` charges an allocation to its
phase, and the LM head's backward recomputation leaves a logged-only entropy out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
CLEAR_REFS = Path("/proc/self/clear_refs")
needs_linux_rss = pytest.mark.skipif(
    not (CLEAR_REFS.exists() and os.access(CLEAR_REFS, os.W_OK)), reason="needs Linux /proc/self/clear_refs"
)


PEAK_METER_PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from memory_profile import PeakMeter
meter = PeakMeter()
with meter.phase("forward"):
    with meter.phase("backward"):  # nested: belongs to the outer phase
        block = torch.ones(64 * 2**18)  # 64 MiB, written so it is resident
    del block
with meter.phase("optimizer"):
    kept = torch.ones(16 * 2**18)  # 16 MiB that outlive the phase
print(json.dumps({"peaks": meter.peaks, "ends": meter.ends, "calls": meter.calls}))
"""


@needs_linux_rss
def test_peak_meter_charges_an_allocation_to_its_phase() -> None:
    # a fresh process: in a long test session freed pages are reused and an allocation need not raise the RSS
    out = subprocess.run(
        [sys.executable, "-c", PEAK_METER_PROBE, str(BENCHMARKS)], capture_output=True, text=True, check=True
    ).stdout
    meter = json.loads(out.strip().splitlines()[-1])
    assert meter["peaks"]["forward"] >= 60 and "backward" not in meter["peaks"]
    assert meter["ends"]["forward"] < meter["peaks"]["forward"] - 50  # freed before the phase ended
    assert 14 <= meter["peaks"]["optimizer"] < 40 and meter["ends"]["optimizer"] >= 14
    assert meter["calls"] == {"forward": 1, "optimizer": 1}


def test_head_logprobs_backward_replay_skips_a_logged_only_entropy(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_memrl.logprobs import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (expected_grad,) = torch.autograd.grad(expected.sum(), hidden)
    calls: list[int] = []
    real = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    logprobs, entropy = head_logprobs(hidden, head, ids, 0.7, with_entropy=True, chunk_tokens=3, entropy_grad=False)
    assert len(calls) == 4 and entropy.shape == (2, 5)  # 10 positions in chunks of 3: the entropy of each
    logprobs.sum().backward()
    assert len(calls) == 4  # the backward's recomputation of each chunk left the entropy out (main: 8)
    torch.testing.assert_close(hidden.grad, expected_grad, atol=1e-6, rtol=0)


def test_torch_profile_records_only_the_chosen_call(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from memory_torch_profile import profiled_call

    events: list[str] = []

    class Prof:
        def start(self) -> None:
            events.append("start")

        def stop(self) -> None:
            events.append("stop")

    def update(x: int) -> int:
        events.append(f"update {x}")
        if x == 2:
            raise RuntimeError("boom")
        return 2 * x

    wrapped = profiled_call(update, Prof(), index=1)
    assert [wrapped(0), wrapped(1)] == [0, 2]
    with pytest.raises(RuntimeError):
        profiled_call(update, Prof(), index=0)(2)  # the profiler stops even when the call fails
    assert events == ["update 0", "start", "update 1", "stop", "start", "update 2", "stop"]


def test_torch_profile_of_the_update_gives_live_tensor_bytes_by_category(monkeypatch, tmp_path) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.chdir(BENCHMARKS.parent)
    from memory_profile import build, parse_args
    from memory_torch_profile import profile_report, worker_torch_profile

    args = parse_args(["--config", "configs/memagent/tiny.yaml", "--steps", "1", "--torch_profile", "--top", "3"])
    args.overrides += ["--trainer.default_root_dir", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        result = worker_torch_profile(args, build)
    finally:
        torch.set_num_threads(threads)  # the worker sets --threads for the whole process
    assert "live_at_peak_error" not in result
    categories = result["by_category_mib"]
    assert categories["parameter"] > 0 and categories["activation"] > 0  # the update's forward kept its activations
    assert sum(categories.values()) == pytest.approx(result["peak_tensor_mib"])
    assert len(result["largest_tensors"]) == 3 and len(result["operators"]) == 3
    assert "tensor memory at the profiled call's peak" in profile_report(result)
