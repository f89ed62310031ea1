"""Packaging: the repo's ``callbacks/`` folder ships as ``lightning_memrl.callbacks``.

``pyproject.toml`` maps the import name ``lightning_memrl.callbacks`` onto the top-level folder
``callbacks/`` (``[tool.setuptools.package-dir]``). These tests check that mapping twice: through
the editable install of the dev venv, and through a real wheel installed into a fresh venv where
the editable finder is not active.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CALLBACK_NAMES = ("MemRLCallback", "OverlongPenalty", "MemoryTokenCredit")

requires_build = pytest.mark.skipif(
    importlib.util.find_spec("build") is None,
    reason="the 'build' package is not importable (install the dev extra: pip install -e '.[dev]')",
)

# Run in a child interpreter: where lightning_memrl.callbacks comes from, and a smoke test of
# OverlongPenalty (lengths 4, 8, 12 with max_length=10, cache_length=4 -> 0, -0.5, -1).
_PROBE = r"""
import importlib.util, json, sys
from types import SimpleNamespace
import torch
import lightning_memrl
import lightning_memrl.callbacks as cb
from lightning_memrl.callbacks.overlong import soft_overlong_penalty

mask = torch.tensor([[1] * n + [0] * (12 - n) for n in (4, 8, 12)])
rollouts = SimpleNamespace(response_mask=mask, memory_turns=torch.zeros(3, dtype=torch.bool),
                           turn_rewards=torch.zeros(3))
penalty = cb.OverlongPenalty(max_length=10, cache_length=4)
penalty.on_rewards(None, None, rollouts)
print(json.dumps({
    "callbacks_file": cb.__file__,
    "overlong_file": sys.modules["lightning_memrl.callbacks.overlong"].__file__,
    "package_file": lightning_memrl.__file__,
    "names": {name: hasattr(cb, name) for name in __NAMES__},
    "subclass": issubclass(cb.OverlongPenalty, cb.MemRLCallback) and issubclass(cb.MemoryTokenCredit, cb.MemRLCallback),
    "turn_rewards": rollouts.turn_rewards.tolist(),
    "penalised_turns": penalty.penalised_turns,
    "soft": soft_overlong_penalty(torch.tensor([6, 7]), 10, 4).tolist(),
    "top_level_callbacks": importlib.util.find_spec("callbacks") is not None,
    "editable_finder": any("__editable__" in (getattr(f, "__module__", "") or "") for f in sys.meta_path),
}))
""".replace("__NAMES__", repr(CALLBACK_NAMES))


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    shown = " ".join(cmd[:3] + (["..."] if len(cmd) > 3 else []))
    assert proc.returncode == 0, f"{shown} failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _probe(python: str | Path, cwd: Path) -> dict:
    # -I: ignore PYTHON* variables and user site, and do not put the cwd on sys.path.
    out = _run([str(python), "-I", "-c", _PROBE], cwd=cwd).stdout
    return json.loads(out.strip().splitlines()[-1])


def _check_probe(result: dict) -> None:
    assert result["names"] == dict.fromkeys(CALLBACK_NAMES, True)
    assert result["subclass"]
    assert result["turn_rewards"] == pytest.approx([0.0, -0.5, -1.0])
    assert result["penalised_turns"] == 2
    assert result["soft"] == pytest.approx([0.0, -0.25])
    assert not result["top_level_callbacks"], "a top-level 'callbacks' package is importable"


# --------------------------------------------------------------------------- editable install
def test_editable_import_resolves_to_repo_callbacks_folder():
    import lightning as L

    import lightning_memrl.callbacks as cb
    from lightning_memrl.callbacks import overlong

    assert Path(cb.__file__).resolve() == REPO / "callbacks" / "__init__.py"
    assert Path(overlong.__file__).resolve() == REPO / "callbacks" / "overlong.py"
    assert set(CALLBACK_NAMES) <= set(cb.__all__)
    for name in CALLBACK_NAMES:
        assert isinstance(getattr(cb, name), type)
    assert issubclass(cb.MemRLCallback, L.Callback)
    assert issubclass(cb.OverlongPenalty, cb.MemRLCallback)
    assert issubclass(cb.MemoryTokenCredit, cb.MemRLCallback)
    # one module object per file, not a second copy imported under another name
    assert cb.OverlongPenalty.__module__ == "lightning_memrl.callbacks.overlong"
    assert "callbacks" not in sys.modules


def test_editable_import_works_outside_the_repo(tmp_path):
    """From another cwd, only the editable finder can map the import name onto ``callbacks/``."""
    result = _probe(sys.executable, cwd=tmp_path)
    assert Path(result["callbacks_file"]).resolve() == REPO / "callbacks" / "__init__.py"
    assert Path(result["package_file"]).resolve() == REPO / "lightning_memrl" / "__init__.py"
    _check_probe(result)


# --------------------------------------------------------------------------- built wheel
@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    outdir = tmp_path_factory.mktemp("wheel")
    had_build_dir = (REPO / "build").exists()
    try:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(outdir)]
        _run(cmd, cwd=REPO, timeout=180)
    finally:
        if not had_build_dir:  # leave the checkout as we found it (build/ is git-ignored anyway)
            shutil.rmtree(REPO / "build", ignore_errors=True)
    wheels = sorted(outdir.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@requires_build
def test_wheel_ships_callbacks_under_lightning_memrl(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        top_level_packages = zf.read(top_level).decode().split()
    assert "lightning_memrl/callbacks/overlong.py" in names
    for source in sorted((REPO / "callbacks").glob("*.py")):
        assert f"lightning_memrl/callbacks/{source.name}" in names, f"{source.name} missing from the wheel"
    assert "lightning_memrl/__init__.py" in names
    assert not [n for n in names if n.startswith("callbacks/")], "wheel ships a top-level callbacks/ package"
    assert top_level_packages == ["lightning_memrl"]


@requires_build
def test_wheel_installs_and_imports_in_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    purelib = _run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=tmp_path)
    fresh_site = Path(purelib.stdout.strip()).resolve()
    # The heavy dependencies (torch, lightning, ...) come from this venv. A directory added by a
    # .pth line is not scanned for .pth files itself, so the editable finder stays inactive.
    dev_sites = dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib"))
    (fresh_site / "zz_dev_site_packages.pth").write_text("".join(f"{p}\n" for p in dev_sites))

    result = _probe(python, cwd=tmp_path)
    assert not result["editable_finder"], "the editable install's finder leaked into the fresh venv"
    callbacks_file = Path(result["callbacks_file"]).resolve()
    assert callbacks_file.is_relative_to(fresh_site), callbacks_file
    assert callbacks_file == fresh_site / "lightning_memrl" / "callbacks" / "__init__.py"
    assert Path(result["overlong_file"]).resolve() == fresh_site / "lightning_memrl" / "callbacks" / "overlong.py"
    assert Path(result["package_file"]).resolve().is_relative_to(fresh_site)
    _check_probe(result)
