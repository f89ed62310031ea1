"""Hand freed tensor memory back to the system between the phases of a step (Linux, glibc).

torch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold (128 KiB at
start) with a mapping of its own that ``free`` returns at once, but every such ``free`` raises the
threshold to the freed size (up to 32 MiB). After the first training step nearly every activation,
logits chunk and KV cache is below the raised threshold, so it comes from the heap, and a freed heap
block stays resident: RSS climbs to the sum of what each phase ever held rather than what is live.

:func:`trim` (``malloc_trim(0)``) hands the heap's free pages back; the module calls it after the
rollout, after the old/reference log-probs and after each micro-batch's forward and backward.
Measured on the quickstart step (``benchmarks/memory_profile.py --steps 2``, bf16 base, README
"Memory, phase by phase"): peak RSS above the post-import baseline 4489 → 3174 MiB (gradient
checkpointing on: 2167 → 1422 MiB), RSS left after the step 3852 → 1326 MiB, median step time within
noise (28.3 s against 29.2 s untrimmed over five steps). Fixing the mmap threshold at 1 MiB instead
(``MALLOC_MMAP_THRESHOLD_=1048576``) gave a peak of 2838 MiB but slowed the rollout by 21% and the
forward and backward by 57% and 45% (page faults), so it is not the default; a user who prefers it
(or another allocator in ``LD_PRELOAD``) sets it, and then nothing here runs.
``LIGHTNING_MEMRL_MALLOC=glibc`` also keeps glibc as it is. ``LIGHTNING_MEMRL_MALLOC=phases`` trims
after the rollout and the old/reference log-probs only, not after each micro-batch: each trim hands back
pages the next micro-batch maps again, and page faults are slow in a virtual machine. Measured on the
quickstart (2-core AMD EPYC, KVM guest, bf16 base, 2 threads): median step 20.0 s against 22.8-23.0 s,
step peak above the post-import RSS 4048 against 3194 MiB. Elsewhere (macOS, Windows, musl) nothing
happens. Where tcmalloc is installed, the ``lightning-memrl`` program runs under it
(:mod:`lightning_memrl.preload`: faster steps at about the same peak) and nothing here runs either.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from functools import cache
from typing import Any

from lightning_memrl.errors import ConfigError

OPT_OUT = "LIGHTNING_MEMRL_MALLOC"  # "glibc": leave the allocator as glibc runs it; "phases": no micro-batch trims
KEEP_GLIBC, PHASES_ONLY, TCMALLOC = "glibc", "phases", "tcmalloc"  # tcmalloc: see lightning_memrl.preload
EVERY_TRIM = "trim"  # glibc trimmed between phases and micro-batches, also where tcmalloc is installed
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@cache
def glibc() -> Any | None:
    """glibc's ``libc.so.6`` with ``malloc_trim``, or None where this is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (musl has no such symbol)
        return libc if hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None


def check_setting(environ: Mapping[str, str]) -> None:
    """Raise a ConfigError for a ``LIGHTNING_MEMRL_MALLOC`` value other than ``glibc``, ``phases``, ``trim`` or
    ``tcmalloc``."""
    value = environ.get(OPT_OUT, "")
    if value and value.lower() not in (KEEP_GLIBC, PHASES_ONLY, EVERY_TRIM, TCMALLOC):
        raise ConfigError(
            f"environment variable {OPT_OUT}={value!r}: use 'glibc' (no trimming), 'phases' (trim between phases "
            "only), 'trim' (trim between phases and micro-batches), 'tcmalloc' (run under tcmalloc, which must be "
            "installed) or leave it unset (tcmalloc where installed, else 'trim')"
        )


def user_choice(environ: Mapping[str, str]) -> str | None:
    """The user's own allocator setting that :func:`trim` leaves alone, in words (None: none)."""
    if environ.get(OPT_OUT, "").lower() == KEEP_GLIBC:
        return f"{OPT_OUT}={KEEP_GLIBC}"
    for name in USER_SETTINGS:
        if environ.get(name):
            return f"{name}={environ[name]}"
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    preload = environ.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} in LD_PRELOAD"
    return None


@cache
def _enabled() -> bool:
    """Whether :func:`trim` runs in this process (glibc, and no allocator choice of the user's)."""
    return glibc() is not None and user_choice(os.environ) is None


def trim(libc: Any | None = None, micro_batch: bool = False) -> None:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``).

    Args:
        libc: the C library to call (default glibc's, and only where :func:`user_choice` finds none).
        micro_batch: a trim inside the update's micro-batch loop, which ``LIGHTNING_MEMRL_MALLOC=phases`` skips.
    """
    if micro_batch and os.environ.get(OPT_OUT, "").lower() == PHASES_ONLY:
        return
    if libc is not None:
        libc.malloc_trim(0)
    elif _enabled():
        glibc().malloc_trim(0)
