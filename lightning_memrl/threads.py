"""How many threads torch computes with on the CPU, chosen when the ``lightning-memrl`` command starts.

torch's default is one intra-op thread per physical core of the whole machine, whatever share of it
this process may use and whatever else runs there. Its threads meet at a barrier after every
operation, so one thread that waits for a core holds up all the others: on a 2-core machine shared
with other jobs, 2 threads made a tiny rollout 7–10× slower than 1 thread (39.5 s against 3.7 s).
The cost is lopsided: too few threads on an idle machine cost at most the missing cores' share,
too many on a busy one cost several times the whole run. :func:`choose_num_threads` therefore
takes the smallest of:

* the CPUs this process may run on (``os.sched_getaffinity``: ``taskset``, a container's cpuset);
* the cgroup CPU quota, rounded down (``docker --cpus``, Kubernetes CPU limits);
* the physical cores among those CPUs (a second hyperthread of a core adds little to a matrix product);
* the CPUs that other work leaves free: the machine's CPUs minus those busy, rounded, measured from
  ``/proc/stat`` over a quarter of a second at start (not the 1-minute load average, which still
  counts a command that just ended: ``make train``'s ``validate`` would halve the ``fit`` after it),

and never fewer than 1. ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) set by the user wins: torch
reads it itself and nothing here runs. With several processes per machine (DDP) Lightning's
launcher divides the CPUs among them instead.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

OVERRIDES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user's choice, read by torch at start


@dataclass(frozen=True)
class CpuFacts:
    """What the thread rule reads from the machine (None: not known here).

    Args:
        usable: CPUs this process may run on.
        quota: the cgroup's CPU quota in CPUs; None when unlimited.
        physical_cores: physical cores among the usable CPUs.
        online: CPUs of the machine, the scale of ``load``.
        load: CPUs busy with other work (measured at start; the 1-minute load average where
            ``/proc/stat`` is missing).
    """

    usable: int
    quota: float | None = None
    physical_cores: int | None = None
    online: int | None = None
    load: float | None = None


def choose_num_threads(facts: CpuFacts) -> tuple[int, str]:
    """The intra-op thread count for ``facts`` (see the module docstring) and why, in words."""
    count, why = max(1, facts.usable), f"{facts.usable} usable CPUs"
    if facts.quota is not None and max(1, math.floor(facts.quota)) < count:
        count, why = max(1, math.floor(facts.quota)), f"a CPU quota of {facts.quota:g} CPUs"
    if facts.physical_cores is not None and 0 < facts.physical_cores < count:
        count, why = facts.physical_cores, f"{facts.physical_cores} physical cores among {facts.usable} usable CPUs"
    if facts.load is not None and facts.online:
        free = max(1, math.floor(facts.online - facts.load + 0.5))
        if free < count:
            count = free
            why += f"; {facts.load:.2f} of {facts.online} CPUs busy with other work leave {free} free"
    return count, why


def parse_cgroup_quota(cpu_max: str | None, quota_us: str | None = None, period_us: str | None = None) -> float | None:
    """CPUs of a cgroup quota: v2 ``cpu.max`` (``"150000 100000"``, ``"max 100000"``) or v1 quota and period (µs).

    None when unlimited, unknown or unreadable.
    """
    try:
        if cpu_max is not None:
            quota, period = cpu_max.split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if quota_us is not None and period_us is not None and int(quota_us) > 0:
            return int(quota_us) / int(period_us)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _physical_cores(cpus: set[int]) -> int | None:
    """Distinct cores among ``cpus`` by their hyperthread siblings (Linux sysfs); None when unreadable."""
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        siblings = _read(topology + "core_cpus_list") or _read(topology + "thread_siblings_list")
        if siblings is None:
            return None
        cores.add(siblings)
    return len(cores) or None


def read_cpu_facts() -> CpuFacts:
    """This process's :class:`CpuFacts` (Linux; elsewhere only what ``os`` tells)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    quota = parse_cgroup_quota(
        _read("/sys/fs/cgroup/cpu.max"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    )
    load = busy_cpus(os.cpu_count() or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            load = None
    return CpuFacts(len(cpus), quota, _physical_cores(cpus), os.cpu_count(), load)


def _cpu_times() -> tuple[int, int] | None:
    """(all, idle + iowait) jiffies of the machine from ``/proc/stat``; None where it is unreadable."""
    line = (_read("/proc/stat") or "").split("\n")[0].split()
    if len(line) < 6 or line[0] != "cpu":
        return None
    ticks = [int(t) for t in line[1:]]
    return sum(ticks[:8]), ticks[3] + ticks[4]  # user nice system idle iowait irq softirq steal


def busy_cpus(online: int, interval: float = 0.25) -> float | None:
    """CPUs busy over the next ``interval`` seconds (this process sleeps meanwhile), or None."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times()
    if second is None or second[0] <= first[0]:
        return None
    busy = 1.0 - (second[1] - first[1]) / (second[0] - first[0])
    return max(0.0, busy) * online


def configure_threads(environ: Mapping[str, str] | None = None, facts: CpuFacts | None = None) -> str:
    """Set torch's intra-op threads by :func:`choose_num_threads` unless ``environ`` names a count.

    Args:
        environ: the environment (default ``os.environ``); ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` wins.
        facts: the machine (default :func:`read_cpu_facts`).

    Returns:
        The line that says the count, why, and how to choose another.
    """
    environ = os.environ if environ is None else environ
    for name in OVERRIDES:
        if environ.get(name):
            return f"torch CPU threads: {torch.get_num_threads()} ({name}={environ[name]})"
    count, why = choose_num_threads(facts or read_cpu_facts())
    torch.set_num_threads(count)
    return f"torch CPU threads: {count} ({why}); set OMP_NUM_THREADS=N to choose"


def configure_threads_at_start() -> None:
    """:func:`configure_threads`, its line printed to stderr by the first process of a machine only."""
    line = configure_threads()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr)
