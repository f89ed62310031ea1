"""A callback for the resume tests: before step ``at_step + 1`` it writes ``marker`` and waits for a signal."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L


class PauseAtStep(L.Callback):
    """Waits (at most ``timeout`` s) once ``at_step`` steps and their checkpoints are done, until SIGTERM."""

    def __init__(self, at_step: int, marker: str, timeout: float = 120.0) -> None:
        self.at_step, self.marker, self.timeout = at_step, marker, timeout

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.at_step:
            return
        Path(self.marker).write_text(str(trainer.global_step))
        end = time.monotonic() + self.timeout
        while not trainer.received_sigterm and time.monotonic() < end:  # SIGKILL ends it here
            time.sleep(0.02)
