"""Exact resume through the real ``lightning-memrl`` entry point: SIGKILL after a checkpoint, and SIGTERM.

A run stopped at step 3 and resumed with ``--ckpt_path`` must log the same loss and reward at
steps 4-6 and end with the same weights as a run that was never stopped (CPU, deterministic).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "memagent" / "tiny.yaml")
EXE = str(Path(sys.executable).with_name("lightning-memrl"))


def _args(num_tasks: int, *extra: str) -> list[str]:
    return [
        EXE,
        "fit",
        "--config",
        TINY,
        "--trainer.max_steps",
        "6",
        "--data.init_args.synthetic.num_tasks",
        str(num_tasks),
        "--trainer.limit_val_batches",
        "0",  # no validation: a run takes seconds
        *extra,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])  # the probe callback
    return env


def _run(cwd: Path, num_tasks: int, *extra: str) -> None:
    proc = subprocess.run(_args(num_tasks, *extra), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _paused(cwd: Path, num_tasks: int) -> subprocess.Popen:
    """A 6-step fit that waits before step 4 (step 3 and its checkpoint done) for a signal."""
    marker = cwd / "paused"
    probe = f'{{"class_path": "pause_probe.PauseAtStep", "init_args": {{"at_step": 3, "marker": "{marker}"}}}}'
    proc = subprocess.Popen(
        _args(num_tasks, "--trainer.callbacks+", probe),
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no pause (exit {proc.returncode}):\n{proc.communicate()[1][-4000:]}")
        time.sleep(0.05)
    return proc


def _metrics(cwd: Path) -> dict[int, tuple[float, float]]:
    """(loss, reward) by optimizer step (1-based; the CSV counts from 0) from every metrics.csv of the run."""
    out = {}
    for path in sorted((cwd / "logs" / "tiny" / "csv").glob("version_*/metrics.csv")):
        for row in csv.DictReader(open(path)):
            if row.get("train/loss"):
                out[int(row["step"]) + 1] = (float(row["train/loss"]), float(row["train/reward"]))
    return out


def _weights(cwd: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(cwd / "logs" / "tiny" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 6
    return ckpt["state_dict"]


def _assert_same_run(resumed: Path, straight: Path, steps: range) -> None:
    a, b = _metrics(resumed), _metrics(straight)
    for step in steps:
        assert a[step] == pytest.approx(b[step], abs=1e-6), (step, a[step], b[step])
    wa, wb = _weights(resumed), _weights(straight)
    assert set(wa) == set(wb)
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    assert diff <= 1e-6, f"final weights differ by {diff:.3g}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 6-step runs: 8 tasks (4 batches an epoch) and 6 tasks (3 batches: step 3 ends an epoch)."""
    runs = {}
    for num_tasks in (8, 6):
        cwd = tmp_path_factory.mktemp(f"straight{num_tasks}")
        _run(cwd, num_tasks)
        runs[num_tasks] = cwd
    return runs


@pytest.mark.parametrize("num_tasks", [8, 6], ids=["mid_epoch", "epoch_boundary"])
def test_sigkill_after_step_3_then_resume_matches_an_uninterrupted_run(straight, tmp_path, num_tasks):
    proc = _paused(tmp_path, num_tasks)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    ckpts = sorted((tmp_path / "logs" / "tiny" / "checkpoints").glob("*step=3.ckpt"))
    assert len(ckpts) == 1, ckpts
    assert torch.load(ckpts[0], map_location="cpu", weights_only=False)["global_step"] == 3
    _run(tmp_path, num_tasks, "--ckpt_path", str(ckpts[0]))
    _assert_same_run(tmp_path, straight[num_tasks], range(4, 7))


def test_sigterm_saves_last_ckpt_exits_143_and_resumes_exactly(straight, tmp_path):
    ckpt_dir = tmp_path / "logs" / "tiny" / "checkpoints"
    proc = _paused(tmp_path, 8)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-4000:]
    assert "SIGTERM: stopped after step 4" in stderr
    saved = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 4  # the step running when the signal came is finished and saved
    _run(tmp_path, 8, "--ckpt_path", "last")
    _assert_same_run(tmp_path, straight[8], range(5, 7))


def test_train_loader_state_resumes_mid_epoch_and_at_an_epoch_end():
    """A restored loader continues with the batches an uninterrupted loader gives, in this and later epochs."""
    from lightning_memrl.data.datamodule import MemRLDataModule
    from lightning_memrl.data.synthetic import SyntheticTaskSettings

    dm = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=6), seed=3)
    dm.setup("fit")

    def epochs(loader, first: int, count: int) -> list[list[str]]:
        out = []
        for epoch in range(first, first + count):
            loader.sampler.set_epoch(epoch)  # Lightning does this at every epoch start
            out += [[t.id for t in batch] for batch in loader]
        return out

    straight = epochs(dm.train_dataloader(), 0, 3)
    assert straight[0:3] != straight[3:6]  # every epoch has its own order
    for taken in (1, 3):  # mid-epoch, and after the epoch's last batch
        loader = dm.train_dataloader()
        it = iter(loader)
        head = [[t.id for t in next(it)] for _ in range(taken)]
        state = loader.state_dict()
        resumed = dm.train_dataloader()
        resumed.load_state_dict(state)
        rest = [[t.id for t in batch] for batch in resumed]
        epoch = 0 if taken < 3 else 1  # an epoch's end is saved as the next epoch's start
        assert head + rest + epochs(resumed, epoch + 1, 2 - epoch) == straight, taken
