"""Run ``lightning-memrl`` under tcmalloc where the system has it: the same work, a faster step.

torch's CPU tensors come from ``malloc``. Under glibc's, a step spends much of its time in page faults:
large blocks are mapped on allocation and unmapped on free, and the module's ``malloc_trim`` calls (see
:mod:`lightning_memrl.allocator`) hand back heap pages that the next pass maps again; in a virtual
machine each fault is slow. tcmalloc keeps freed pages for reuse with little fragmentation. Measured on a
2-core Intel Xeon with AMX (KVM guest, bf16, 2 threads; README "Memory allocator"): the quickstart's
median step 16.3-17.2 s under glibc, 11.8-12.3 s under tcmalloc; a LoRA GRPO step of
``benchmarks/grpo_step.py`` 3.79 s against 2.99 s (medians of three runs), its peak RSS 1441 against
1477-1497 MiB.

An allocator can only be chosen before the process starts (``LD_PRELOAD``), so :func:`maybe_reexec` starts
the command again under tcmalloc: when it runs as the ``lightning-memrl`` program (not in-process, as tests
call it) with a subcommand that runs a model, on Linux, where a tcmalloc library is installed (e.g. Debian's
``libtcmalloc-minimal4``) and the user made no allocator choice of their own (``LD_PRELOAD``, ``MALLOC_*``
settings, ``LIGHTNING_MEMRL_MALLOC=glibc``, ``phases`` or ``trim``: glibc trimmed as
:mod:`lightning_memrl.allocator` describes, which hands freed pages back between phases where tcmalloc keeps
them for the rest of the run). ``LIGHTNING_MEMRL_TCMALLOC`` names the library
where it is in none of the folders searched; ``LIGHTNING_MEMRL_MALLOC=tcmalloc`` asks for it and stops with
a message where none is found.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_memrl import allocator
from lightning_memrl.errors import ConfigError

TCMALLOC_FILES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
LIBRARY_OPTION = "LIGHTNING_MEMRL_TCMALLOC"  # the library's path, where it is in no folder searched
MODEL_SUBCOMMANDS = ("fit", "validate", "test", "predict")
QUIET_LARGE_ALLOCS = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"  # tcmalloc reports every allocation above it
INSTALL_HINT = "install tcmalloc (Debian/Ubuntu: apt install libtcmalloc-minimal4; conda: gperftools)"


def find_tcmalloc(dirs: Sequence[str] | None = None) -> str | None:
    """``LIGHTNING_MEMRL_TCMALLOC`` if set (None unless it is a file), else the first tcmalloc library in
    ``dirs`` (default: the Python environment's ``lib`` folders, then the system's)."""
    given = os.environ.get(LIBRARY_OPTION)
    if given:
        return given if Path(given).is_file() else None
    if dirs is None:
        prefixes = [os.environ.get("CONDA_PREFIX", ""), sys.prefix]
        dirs = [str(Path(p) / "lib") for p in prefixes if p] + list(LIBRARY_DIRS)
    for folder in dirs:
        for name in TCMALLOC_FILES:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def preload_environment(environ: Mapping[str, str], library: str | None, platform: str) -> dict[str, str] | None:
    """The environment to start again with under tcmalloc, or None to run as is.

    Raises:
        ConfigError: ``LIGHTNING_MEMRL_MALLOC=tcmalloc`` where no tcmalloc library was found.
    """
    wanted = environ.get(allocator.OPT_OUT, "").lower()
    if wanted == allocator.TCMALLOC and library is None:
        where = (
            f"{LIBRARY_OPTION}={environ[LIBRARY_OPTION]} is not a file" if environ.get(LIBRARY_OPTION) else "none found"
        )
        raise ConfigError(
            f"environment variable {allocator.OPT_OUT}=tcmalloc: {where}; {INSTALL_HINT}, or set {LIBRARY_OPTION} "
            "to the library's path"
        )
    if wanted not in ("", allocator.TCMALLOC) or not platform.startswith("linux") or library is None:
        return None
    if allocator.user_choice(environ) is not None or environ.get("LD_PRELOAD"):
        return None  # the user's choice stands, and a preloaded library stays the only one
    return {**environ, "LD_PRELOAD": library, QUIET_LARGE_ALLOCS: environ.get(QUIET_LARGE_ALLOCS, str(2**40))}


def runs_as_program(orig_argv: Sequence[str]) -> bool:
    """Whether this process is the ``lightning-memrl`` program itself (its script, or ``-m lightning_memrl.cli``)."""
    args = list(orig_argv[1:])
    if args[:2] == ["-m", "lightning_memrl.cli"]:
        return True
    return bool(args) and Path(args[0]).name == "lightning-memrl"


def maybe_reexec(argv: Sequence[str]) -> None:
    """Start this command again under tcmalloc where :func:`preload_environment` says so; else return.

    Args:
        argv: the command's arguments (``sys.argv``); only subcommands that run a model are restarted.
    """
    if len(argv) < 2 or argv[1] not in MODEL_SUBCOMMANDS or not runs_as_program(sys.orig_argv):
        return
    library = find_tcmalloc()
    environ = preload_environment(os.environ, library, sys.platform)
    if environ is None:
        return
    if environ.get("LOCAL_RANK", "0") == "0":
        line = f"memory allocator: tcmalloc ({library}); {allocator.OPT_OUT}=trim runs glibc's, trimmed"
        print(line, file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
