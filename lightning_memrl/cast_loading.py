"""Loading safetensors weights into another dtype without mapping the files: no transient second copy.

``from_pretrained(path, dtype=torch.bfloat16)`` of an fp32 checkpoint memory-maps each safetensors file
and casts it tensor by tensor. Every fp32 page it reads stays mapped, and counted in the process's RSS,
until the file is closed at the end of the load, so the load peaks at the whole fp32 file plus the bf16
weights: three times the weights it ends with (SmolLM2-135M-Instruct: 780 MiB above the RSS before the
load, 269 MiB after it). Read with ``pread`` instead, each tensor lands in a buffer of its own that is
freed once cast, and the load peaks at the weights plus the tensors in flight (279 MiB; the same
weights, bit for bit). Where a file already holds the dtype being loaded, mapping costs nothing extra
(the weights are the file's pages, read when first touched), so only files with floating tensors of
another dtype are read this way.

:func:`read_when_casting` routes ``transformers``' ``safe_open`` accordingly while a load runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def file_float_dtypes(path: str) -> set[torch.dtype]:
    """The floating dtypes of a safetensors file's tensors, from its header (empty if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return set()  # not ours to report: safetensors raises its own error when it opens the file
    entries = (v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))
    return {SAFETENSORS_FLOATS[e["dtype"]] for e in entries if e.get("dtype") in SAFETENSORS_FLOATS}


def casts(path: str, dtype: torch.dtype) -> bool:
    """Whether loading ``path`` as ``dtype`` casts some of its floating tensors."""
    return bool(file_float_dtypes(path) - {dtype})


@contextmanager
def read_when_casting(dtype: torch.dtype) -> Iterator[None]:
    """Inside: ``transformers`` reads a safetensors file it would map with ``pread`` when loading it as ``dtype`` casts.

    Args:
        dtype: the dtype the model is loaded in (``from_pretrained``'s ``dtype``).
    """
    from transformers import modeling_utils

    original = getattr(modeling_utils, "safe_open", None)
    if original is None:  # another transformers layout: its own loading as it is
        yield
        return

    def safe_open(file: Any, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        if backend == "mmap" and casts(str(file), dtype):
            backend = "pread"
        return original(file, *args, **kwargs) if backend is None else original(file, *args, backend=backend, **kwargs)

    modeling_utils.safe_open = safe_open
    try:
        yield
    finally:
        modeling_utils.safe_open = original
