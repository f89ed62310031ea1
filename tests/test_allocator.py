"""Freed heap handed back between phases: glibc's ``malloc_trim``, the user's own allocator choice left alone."""

from __future__ import annotations

import pytest

from lightning_memrl import allocator, preload
from lightning_memrl.allocator import user_choice
from lightning_memrl.errors import ConfigError


class FakeLibc:
    """Counts ``malloc_trim`` calls instead of making them."""

    def __init__(self) -> None:
        self.trims: list[int] = []

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


@pytest.mark.parametrize(
    "environ, reason",
    [
        ({"LIGHTNING_MEMRL_MALLOC": "glibc"}, "LIGHTNING_MEMRL_MALLOC=glibc"),
        ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, "MALLOC_MMAP_THRESHOLD_=1048576"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_=0"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "jemalloc in LD_PRELOAD"),
    ],
)
def test_the_users_choice_is_named(environ: dict[str, str], reason: str) -> None:
    assert user_choice(environ) == reason


def test_unrelated_settings_do_not_count() -> None:
    assert user_choice({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": "libfoo.so"}) is None


def test_trim_calls_malloc_trim_with_no_padding() -> None:
    libc = FakeLibc()
    allocator.trim(libc)
    assert libc.trims == [0]


def test_trim_does_nothing_when_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "glibc", lambda: libc)
    allocator._enabled.cache_clear()
    monkeypatch.setenv("LIGHTNING_MEMRL_MALLOC", "glibc")
    allocator.trim()
    assert libc.trims == []
    allocator._enabled.cache_clear()
    monkeypatch.delenv("LIGHTNING_MEMRL_MALLOC")
    for name in allocator.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    allocator.trim()
    assert libc.trims == [0]
    allocator._enabled.cache_clear()


def test_phases_only_skips_the_micro_batch_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc()
    monkeypatch.setenv("LIGHTNING_MEMRL_MALLOC", "phases")
    allocator.trim(libc, micro_batch=True)
    assert libc.trims == []
    allocator.trim(libc)  # between phases: still trimmed
    assert libc.trims == [0]
    monkeypatch.delenv("LIGHTNING_MEMRL_MALLOC")
    allocator.trim(libc, micro_batch=True)
    assert libc.trims == [0, 0]


def test_an_unknown_setting_stops_naming_the_variable() -> None:
    allocator.check_setting({"LIGHTNING_MEMRL_MALLOC": "Phases"})
    allocator.check_setting({})
    with pytest.raises(ConfigError, match="LIGHTNING_MEMRL_MALLOC='phase'.*'glibc'.*'phases'"):
        allocator.check_setting({"LIGHTNING_MEMRL_MALLOC": "phase"})


def test_trim_and_tcmalloc_settings_keep_every_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """'trim' (and 'tcmalloc' in a process that was not restarted under it) trim as the default does."""
    for value in ("trim", "tcmalloc"):
        allocator.check_setting({"LIGHTNING_MEMRL_MALLOC": value})
        assert allocator.user_choice({"LIGHTNING_MEMRL_MALLOC": value}) is None
        libc = FakeLibc()
        monkeypatch.setenv("LIGHTNING_MEMRL_MALLOC", value)
        allocator.trim(libc, micro_batch=True)
        assert libc.trims == [0]
    assert preload.preload_environment({"LIGHTNING_MEMRL_MALLOC": "trim"}, "/lib/libtcmalloc.so.4", "linux") is None
