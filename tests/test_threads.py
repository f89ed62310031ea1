"""The CPU thread count the command picks: the rule on hand-made machines, and the user's override winning."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_memrl import cli, threads
from lightning_memrl.threads import CpuFacts, choose_num_threads, configure_threads, parse_cgroup_quota


@pytest.mark.parametrize(
    "facts, expected, reason",
    [
        (CpuFacts(usable=8), 8, "8 usable CPUs"),
        (CpuFacts(usable=64, quota=2.5), 2, "a CPU quota of 2.5 CPUs"),  # docker --cpus 2.5 on a big host
        (CpuFacts(usable=8, quota=0.5), 1, "a CPU quota of 0.5 CPUs"),  # never fewer than 1
        (CpuFacts(usable=16, physical_cores=8), 8, "8 physical cores among 16 usable CPUs"),  # hyperthreads
        (CpuFacts(usable=2, physical_cores=2, online=2, load=1.3), 1, "leave 1 free"),  # another job runs
        (CpuFacts(usable=2, physical_cores=2, online=2, load=0.3), 2, "2 usable CPUs"),  # about idle
        (CpuFacts(usable=2, online=2, load=7.0), 1, "7.00 of 2 CPUs busy with other work leave 1 free"),
        (CpuFacts(usable=4, physical_cores=4, online=64, load=30.0), 4, "4 usable CPUs"),  # taskset, busy host
        (
            CpuFacts(usable=8, quota=6.0, online=8, load=4.2),
            4,
            "a CPU quota of 6 CPUs; 4.20 of 8 CPUs busy with other work",
        ),
    ],
)
def test_thread_rule(facts: CpuFacts, expected: int, reason: str) -> None:
    count, why = choose_num_threads(facts)
    assert count == expected
    assert reason in why


@pytest.mark.parametrize(
    "cpu_max, quota_us, period_us, expected",
    [
        ("max 100000", None, None, None),
        ("150000 100000", None, None, 1.5),
        (None, "-1", "100000", None),  # cgroup v1 without a quota
        (None, "200000", "100000", 2.0),
        (None, None, None, None),
        ("garbage", None, None, None),
    ],
)
def test_cgroup_quota(cpu_max, quota_us, period_us, expected) -> None:
    assert parse_cgroup_quota(cpu_max, quota_us, period_us) == expected


@pytest.fixture
def set_threads(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def test_the_rule_sets_torch_threads_and_says_how_to_override(set_threads) -> None:
    line = configure_threads({}, CpuFacts(usable=2, physical_cores=2, online=2, load=1.4))
    assert set_threads == [1]
    assert line.startswith("torch CPU threads: 1 (") and "set OMP_NUM_THREADS=N to choose" in line


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_thread_count_the_user_set_wins(set_threads, name: str) -> None:
    line = configure_threads({name: "3"}, CpuFacts(usable=1))
    assert set_threads == []  # torch read the variable itself; nothing is changed
    assert f"({name}=3)" in line


def test_the_command_applies_the_rule_before_parsing(set_threads, monkeypatch, capsys) -> None:
    for name in threads.OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(threads, "read_cpu_facts", lambda: CpuFacts(usable=6, physical_cores=3))
    monkeypatch.setattr(cli, "build_cli", lambda: set_threads.append(-1))  # parsing starts after the choice
    monkeypatch.setattr(sys, "argv", ["lightning-memrl", "fit"])
    cli.main()
    assert set_threads == [3, -1]
    assert "torch CPU threads: 3 (3 physical cores among 6 usable CPUs)" in capsys.readouterr().err


def test_busy_cpus_reads_the_machine_now_not_the_load_average(monkeypatch):
    from lightning_memrl import threads

    samples = iter([(1000, 600), (1100, 650)])  # 100 jiffies passed, 50 of them idle or waiting
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    assert threads.busy_cpus(4) == 2.0  # (1 - 50/100) of 4 CPUs
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)  # no /proc/stat: the load average instead
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.5, 0.0, 0.0))
    assert threads.read_cpu_facts().load == 3.5
