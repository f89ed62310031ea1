"""What a run prints: the package's INFO lines, a progress bar counting optimizer steps, no known noise.

- :func:`show_info_logs` (called as a run starts, from ``MemRLModule.configure_callbacks``): unless
  logging was configured by then, records of the ``lightning_memrl`` loggers at INFO and above go
  to stderr, as Lightning's own lines do; should the root logger get a handler later, the records
  go to it instead, never printed twice.
- :func:`quiet_known_noise`: one bitsandbytes log line and one Lightning warning that do not apply
  to this package's runs are dropped (each filter names the exact message and why).
- :func:`use_step_progress_bar`: Lightning's default progress bar counts optimizer steps up to
  ``trainer.max_steps`` ("Steps 3/20") instead of an epoch's batches ("Epoch 0/-2").
- :func:`progress_bar_metrics`: the step metrics the bar shows next to the counter.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

PACKAGE_LOGGER = "lightning_memrl"

# bitsandbytes (0.50) logs this on every import on CPUs with AVX512-BF16 when the optional `kernels`
# package (a hub download of a CPU 4-bit matmul kernel) is missing. peft imports bitsandbytes for any
# LoRA model, quantised or not, and this package never runs that kernel: 4-bit layers keep their
# portable layout (models.keep_4bit_layout), so the line is noise on every LoRA run.
BNB_LOGGER, BNB_KERNEL_LINE = "bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"

# Lightning warns (13 lines with sample code) on every ModelCheckpoint(every_n_train_steps=...) save of a
# module with manual optimization, because the checkpoint holds the weights after the step's optimizer
# step. That is what MemRLModule means: the checkpoint of step N holds the weights after N updates, and
# resuming from it runs step N + 1.
CHECKPOINT_WARNING = "Using ModelCheckpoint with manual optimization and every_n_train_steps"

# The bar's name of each step metric (module.py logs them with prog_bar=True), in the order shown.
PROGRESS_BAR_METRICS = {"train/reward": "reward", "train/loss": "loss", "train/kl": "kl", "time/step_s": "step_s"}


class _ConsoleHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (a progress bar may redirect it) while the root logger has no handler."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # logging is configured: the record propagates to the user's handlers instead
        self.stream = sys.stderr
        super().emit(record)


def show_info_logs() -> None:
    """Print the package's INFO (and higher) records on stderr unless logging is already configured.

    Does nothing when the root logger has handlers (e.g. ``logging.basicConfig`` ran first) or the
    ``lightning_memrl`` logger has a level or handler of its own; idempotent. Set
    ``logging.getLogger("lightning_memrl").setLevel(logging.WARNING)`` to hide the INFO lines.
    """
    logger = logging.getLogger(PACKAGE_LOGGER)
    if logging.getLogger().handlers or logger.handlers or logger.level != logging.NOTSET:
        return
    handler = _ConsoleHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _not_bnb_kernel_line(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BNB_KERNEL_LINE)


def quiet_known_noise() -> None:
    """Drop bitsandbytes' CPU-kernel line and Lightning's manual-optimization checkpoint warning (see above).

    Idempotent; the filters match those two messages only.
    """
    bnb = logging.getLogger(BNB_LOGGER)
    if _not_bnb_kernel_line not in bnb.filters:
        bnb.addFilter(_not_bnb_kernel_line)
    warnings.filterwarnings("ignore", message=CHECKPOINT_WARNING, category=UserWarning)


class _StepCount:
    """The training bar's total is ``trainer.max_steps`` (when set) and it advances to ``trainer.global_step``."""

    trainer: Any

    @property
    def total_train_batches(self) -> int | float:
        steps = self.trainer.max_steps
        return steps if steps > 0 else super().total_train_batches  # type: ignore[misc]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.max_steps > 0:
            batch_idx = trainer.global_step - 1  # the bar shows batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]


def _train_description(trainer: Any) -> str:
    if trainer.max_steps > 0:
        return "Steps"
    epochs = trainer.max_epochs
    return f"Epoch {trainer.current_epoch}" + (f"/{epochs - 1}" if epochs is not None and epochs > 0 else "")


class StepRichProgressBar(_StepCount, RichProgressBar):
    """Lightning's rich bar counting optimizer steps: ``Steps ━━━━ 3/20 ... reward: 0.4 loss: 0.01``."""

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{_train_description(self.trainer):{len(self.validation_description)}}"  # padded as Lightning does


class StepTQDMProgressBar(_StepCount, TQDMProgressBar):
    """Lightning's tqdm bar counting optimizer steps: ``Steps: 15%| 3/20 [...]``."""

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(_train_description(trainer))


def use_step_progress_bar(trainer: Any) -> None:
    """Make the trainer's progress bar count optimizer steps, when it is one of Lightning's two defaults.

    The bar object is kept (with its theme, refresh rate and console settings) and becomes the
    matching step-counting subclass; a bar of the user's own class is left alone.
    """
    bar = trainer.progress_bar_callback
    step_bar = {RichProgressBar: StepRichProgressBar, TQDMProgressBar: StepTQDMProgressBar}.get(type(bar))
    if step_bar is not None:
        bar.__class__ = step_bar


def progress_bar_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The bar's share of a step's metrics: reward, loss, KL (when there is a KL term) and seconds per step."""
    return {short: metrics[key] for key, short in PROGRESS_BAR_METRICS.items() if key in metrics}
