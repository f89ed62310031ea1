"""The lightning-memrl program starts again under tcmalloc where installed, unless the user chose an allocator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memrl import preload
from lightning_memrl.errors import ConfigError

LIB = "/opt/lib/libtcmalloc_minimal.so.4"
REPO = Path(__file__).resolve().parents[1]


def test_find_tcmalloc_takes_the_first_folder_that_has_one(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "libtcmalloc.so.4").write_bytes(b"")
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert preload.find_tcmalloc(dirs) == str(tmp_path / "b" / "libtcmalloc.so.4")
    (tmp_path / "a" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert preload.find_tcmalloc(dirs) == str(tmp_path / "a" / "libtcmalloc_minimal.so.4")
    assert preload.find_tcmalloc([str(tmp_path / "missing")]) is None


def test_preload_environment_where_found_and_nothing_chosen():
    env = preload.preload_environment({"PATH": "/bin"}, LIB, "linux")
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB, preload.QUIET_LARGE_ALLOCS: str(2**40)}
    kept = preload.preload_environment({preload.QUIET_LARGE_ALLOCS: "5"}, LIB, "linux")
    assert kept is not None and kept[preload.QUIET_LARGE_ALLOCS] == "5"  # the user's threshold stands


@pytest.mark.parametrize(
    "environ",
    [
        {"LIGHTNING_MEMRL_MALLOC": "glibc"},
        {"LIGHTNING_MEMRL_MALLOC": "phases"},
        {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
        {"LD_PRELOAD": "/opt/libsomething.so"},  # any preloaded library: not ours to add to
        {"MALLOC_MMAP_THRESHOLD_": "1048576"},
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    ],
)
def test_a_choice_of_the_users_runs_as_is(environ):
    assert preload.preload_environment(environ, LIB, "linux") is None


def test_not_found_or_not_linux_runs_as_is_unless_asked_for():
    assert preload.preload_environment({}, None, "linux") is None
    assert preload.preload_environment({}, LIB, "darwin") is None
    with pytest.raises(ConfigError, match="LIGHTNING_MEMRL_MALLOC=tcmalloc: none found; install tcmalloc.*apt install"):
        preload.preload_environment({"LIGHTNING_MEMRL_MALLOC": "tcmalloc"}, None, "linux")
    asked = preload.preload_environment({"LIGHTNING_MEMRL_MALLOC": "TCMALLOC"}, LIB, "linux")
    assert asked is not None and asked["LD_PRELOAD"] == LIB


def test_runs_as_program_only_for_the_entry_point():
    assert preload.runs_as_program(["/venv/bin/python", "/venv/bin/lightning-memrl", "fit"])
    assert preload.runs_as_program(["python", "-m", "lightning_memrl.cli", "fit"])
    assert not preload.runs_as_program(["python", "-m", "pytest", "tests"])  # in-process calls never restart
    assert not preload.runs_as_program(["python"])


def test_maybe_reexec_starts_the_same_command_under_tcmalloc(monkeypatch, capsys):
    calls = []
    orig = ["/venv/bin/python", "/venv/bin/lightning-memrl", "fit", "--config", "c.yaml"]
    monkeypatch.setattr(sys, "orig_argv", orig)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(preload, "find_tcmalloc", lambda: LIB)
    monkeypatch.setattr(preload.os, "execve", lambda *args: calls.append(args))
    for name in ("LD_PRELOAD", "LIGHTNING_MEMRL_MALLOC", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    preload.maybe_reexec(["lightning-memrl", "plot", "logs"])  # no model runs: as is
    preload.maybe_reexec(["lightning-memrl", "--help"])
    assert calls == []
    preload.maybe_reexec(["lightning-memrl", "fit", "--config", "c.yaml"])
    ((program, argv, environ),) = calls
    assert program == sys.executable and argv == [sys.executable, *orig[1:]]
    assert environ["LD_PRELOAD"] == LIB and environ["PATH"] == os.environ["PATH"]
    assert f"memory allocator: tcmalloc ({LIB})" in capsys.readouterr().err


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lightning-memrl")
    return subprocess.run([str(exe), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_cli_asked_for_tcmalloc_where_none_is_found_stops_with_one_line(tmp_path):
    env = {**os.environ, "LIGHTNING_MEMRL_MALLOC": "tcmalloc", preload.LIBRARY_OPTION: str(tmp_path / "none.so")}
    env.pop("LD_PRELOAD", None)
    done = _cli(["validate", "--config", str(REPO / "configs/memagent/tiny.yaml")], env, tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: environment variable LIGHTNING_MEMRL_MALLOC=tcmalloc: LIGHTNING_MEMRL_TCMALLOC=")


def test_cli_restarts_once_under_the_library_and_runs(tmp_path):
    """The restarted process sees the library in LD_PRELOAD and runs; a file the loader cannot preload (as
    here, where no tcmalloc need be installed) is skipped by it with a warning, and the run goes on."""
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    fake.write_bytes(b"not a library")
    env = {**os.environ, preload.LIBRARY_OPTION: str(fake)}
    for name in ("LD_PRELOAD", "LIGHTNING_MEMRL_MALLOC"):
        env.pop(name, None)
    args = [
        "validate",
        "--config",
        str(REPO / "configs/memagent/tiny.yaml"),
        "--data.init_args.synthetic_val.num_tasks=4",
    ]
    done = _cli([*args, "--trainer.logger=false"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count(f"memory allocator: tcmalloc ({fake})") == 1  # restarted once, not again
    assert "cannot be preloaded" in done.stderr  # the loader skipped the stand-in: the run went on without it
