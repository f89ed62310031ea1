"""Exact resume: random-number-generator states in checkpoints, and a checkpoint and exit code 143 on SIGTERM.

The training loader (a ``StatefulDataLoader``) is saved and restored by Lightning itself; this
callback adds what Lightning leaves out: the global torch (CPU and CUDA), Python and NumPy RNG
states, which rollouts sample from. ``MemRLModule.configure_callbacks`` attaches it to every run.
"""

from __future__ import annotations

import logging
import random
import signal
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # 143: the shell's code for a process ended by SIGTERM


def rng_states() -> dict[str, Any]:
    """The global torch (CPU, every CUDA device), Python and NumPy RNG states, as plain types and tensors."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(state), python_gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    """Set the global RNGs to ``states`` (from :func:`rng_states`); CUDA states only for devices present."""
    torch.set_rng_state(states["torch"])
    cuda = states.get("torch_cuda") or []
    if cuda and torch.cuda.is_available():
        for device, state in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, device)
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class ExactResume(L.Callback):
    """Saves the RNG states with every checkpoint and restores them right before the first resumed step.

    On SIGTERM (Lightning stops after the current step) it saves ``last.ckpt`` in the checkpoint
    folder (the ``ModelCheckpoint``'s ``dirpath``, else ``<default_root_dir>/checkpoints``) and
    sets the exit code to 143 (128 + SIGTERM) so a scheduler sees an interrupted run, not a finished one.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        self._saved_step = -1  # global step of the last SIGTERM checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_states()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict.get("rng")  # applied at the first resumed step: sanity checks sample nothing of ours

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._pending is not None:
            restore_rng_states(self._pending)
            self._pending = None

    @staticmethod
    def sigterm_checkpoint_path(trainer: L.Trainer) -> Path:
        """Where a SIGTERM checkpoint goes: ``last.ckpt`` next to the ``ModelCheckpoint``'s files."""
        callback = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        return Path(folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # where ModelCheckpoint saves: Lightning resumes this loop state exactly, also at an epoch's last batch
        if trainer.received_sigterm and trainer.state.fn == "fit":
            self._save_on_sigterm(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        if self._saved_step != trainer.global_step:  # the signal came after the step's end (e.g. in validation)
            self._save_on_sigterm(trainer)
        exception.code = SIGTERM_EXIT_CODE
        if trainer.is_global_zero:
            path = self.sigterm_checkpoint_path(trainer)
            log.warning(
                "SIGTERM: stopped after step %d; saved %s; resume with --ckpt_path %s (exit code %d)",
                trainer.global_step,
                path,
                path,
                SIGTERM_EXIT_CODE,
            )

    def _save_on_sigterm(self, trainer: L.Trainer) -> None:
        path = self.sigterm_checkpoint_path(trainer)
        if path.is_symlink():  # save_last="link": write a file, not through the link
            path.unlink()
        trainer.save_checkpoint(path)
        self._saved_step = trainer.global_step
