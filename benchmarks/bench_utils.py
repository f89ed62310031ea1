"""Pieces the benchmark scripts share: machine facts, memory, workers, the model under test, tables.

Each benchmark runs every side it compares in its own worker subprocess (``run_worker``), so peak
RSS and thread settings are per side, and writes its result under ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.model_paths import resolve_model_path
from lightning_memrl.models import build_tiny_model, build_tiny_tokenizer

RESULTS = Path(__file__).parent / "results"
TINY = "tiny"


def cpu_bf16_supported() -> bool:
    """True when this CPU runs bf16 matrix products in hardware (AVX512-BF16 or AMX), as oneDNN reports."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


SPEED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags (``lscpu``'s) that decide matrix-product speed, from ``/proc/cpuinfo``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in SPEED_FLAGS if flag in present]
    except OSError:
        pass
    return []


def code_version() -> str:
    """The checkout's commit, marked ``+modified`` when ``lightning_memrl/`` has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "lightning_memrl", "callbacks"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + ("+modified" if dirty else "")


def allocator(cli: bool = False) -> str:
    """The memory allocator a run uses: ``LD_PRELOAD``'s, else (``cli``: a ``lightning-memrl`` run) tcmalloc where
    the program restarts under it (``lightning_memrl.preload``), else glibc with the module's trimming setting."""
    from lightning_memrl import preload

    if os.environ.get("LD_PRELOAD"):
        return f"LD_PRELOAD={os.environ['LD_PRELOAD']}"
    if cli:
        restart = preload.preload_environment(os.environ, preload.find_tcmalloc(), sys.platform)
        if restart is not None:
            return f"tcmalloc ({restart['LD_PRELOAD']}), the CLI's choice"
    return f"glibc, LIGHTNING_MEMRL_MALLOC={os.environ.get('LIGHTNING_MEMRL_MALLOC') or 'unset (trim)'}"


def machine(threads: int, cli: bool = False) -> dict[str, Any]:
    """Facts that make a timing comparable: CPU, ISA level and flags, bf16 support, threads, versions, commit,
    and the memory allocator (``cli``: of a ``lightning-memrl`` run, see :func:`allocator`)."""
    import transformers

    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "bf16_hardware": cpu_bf16_supported(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "code": code_version(),
        "allocator": allocator(cli),
    }


def set_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads (and one inter-op thread) in this process."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once parallel work started
        pass


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (``ru_maxrss`` is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def rss_mib() -> float:
    """Current resident set size of this process, in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / (1024 * 1024)


def param_mib(model: torch.nn.Module) -> float:
    """Bytes of a model's parameters and buffers, in MiB (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total / (1024 * 1024)


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (NaN when empty)."""
    return statistics.median(values) if values else float("nan")


def resolve_model(name: str, workdir: Path) -> str:
    """A model folder both sides of a benchmark load with ``from_pretrained``.

    ``tiny`` builds the random tiny model and its tokenizer (``lightning_memrl.models``, offline)
    and saves them under ``workdir``, so every side loads the same weights; any other name goes
    through ``resolve_model_path`` (the default SmolLM2 resolves to a local folder offline).
    """
    if name != TINY:
        return resolve_model_path(name)
    out = workdir / "tiny-model"
    if not (out / "config.json").is_file():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        tokenizer = build_tiny_tokenizer()
        build_tiny_model(tokenizer, seed=0).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return str(out)


def model_tag(name: str) -> str:
    """Short name of a model for result files: ``tiny``, ``SmolLM2-135M-Instruct``, a folder's name."""
    return name if name == TINY else Path(name.rstrip("/")).name


def run_worker(script: str, worker_args: list[str], label: str) -> dict[str, Any]:
    """Run ``python script --worker ...`` in a fresh process and return the JSON it writes.

    The worker gets ``--worker_out FILE`` and must write its result there. On failure the
    worker's output is shown and the benchmark stops, naming the side that failed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, script, *worker_args, "--worker_out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"{label}: worker failed (exit {proc.returncode}): {' '.join(cmd)}")
        return json.loads(out.read_text())


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table; floats get 4 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "n/a" if value != value else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def comparison_table(
    labels: dict[str, str],
    results: dict[str, dict[str, Any]],
    sides: list[str],
    ratios: dict[str, float],
    side_names: dict[str, str],
    ratio_header: str,
) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of a side-by-side table: one row per ``labels`` key, a ratio column when ``ratios``."""
    rows = []
    for key, label in labels.items():
        row = [label, *[results[s][key] for s in sides]]
        if ratios:
            row.append(ratios.get(key, float("nan")))
        rows.append(row)
    headers = ["", *[side_names[s] for s in sides]]
    if ratios:
        headers.append(ratio_header)
    return headers, rows


def ratio(ours: float, theirs: float) -> float:
    """``ours / theirs`` (NaN when either is missing or ``theirs`` is 0)."""
    return ours / theirs if theirs and ours == ours and theirs == theirs else float("nan")


def tagged(name: str, tag: str) -> str:
    """``name`` with ``_<tag>`` appended when a tag is given (a result file per machine or variant)."""
    return f"{name}_{tag}" if tag else name


def write_result(name: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as ``benchmarks/results/<name>.json``; returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
