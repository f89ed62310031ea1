"""Where a run's outputs go, and no empty run folders after a failed run.

Every logger without a ``save_dir`` writes under ``trainer.default_root_dir`` and every
``ModelCheckpoint`` without a ``dirpath`` saves to ``<default_root_dir>/checkpoints``, so
``--trainer.default_root_dir X`` moves a whole run. A run that fails before its first optimizer
step leaves no ``version_N`` folder holding only set-up files (see :func:`prune_failed_run`).
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

log = logging.getLogger(__name__)

# what a run writes into its version folder before it has logged anything
SETUP_FILES = ("hparams.yaml", "config.yaml")
SETUP_PREFIXES = ("events.out.tfevents.",)


def _as_list(value: Any) -> list[Any]:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _is_subclass(class_path: str, base: type) -> bool:
    """Whether the parsed ``class_path`` (a full dotted path) names ``base`` or a subclass of it."""
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):  # jsonargparse names an unknown class when it builds it
        return False
    return isinstance(found, type) and issubclass(found, base)


def fill_output_dirs(trainer: Namespace) -> dict[str, str]:
    """Set unset logger ``save_dir`` and ``ModelCheckpoint`` ``dirpath`` from ``trainer.default_root_dir``.

    Args:
        trainer: the parsed ``trainer`` section of a subcommand's config (changed in place).

    Returns:
        ``{option: path}`` of what was filled in, e.g. ``{"trainer.logger[0].save_dir": "logs/tiny"}``.
    """
    root = str(trainer.get("default_root_dir") or os.getcwd())
    filled = {}
    loggers = _as_list(trainer.get("logger"))
    for i, spec in enumerate(loggers):
        if isinstance(spec, Namespace) and spec.get("init_args") is not None and spec.init_args.get("save_dir") is None:
            spec.init_args["save_dir"] = root
            filled[f"trainer.logger[{i}].save_dir"] = root
    for i, spec in enumerate(_as_list(trainer.get("callbacks"))):
        if not isinstance(spec, Namespace) or not _is_subclass(spec.get("class_path", ""), ModelCheckpoint):
            continue
        if spec.get("init_args") is None:
            spec["init_args"] = Namespace()
        if spec.init_args.get("dirpath") is None:
            spec.init_args["dirpath"] = os.path.join(root, "checkpoints")
            filled[f"trainer.callbacks[{i}].dirpath"] = spec.init_args["dirpath"]
    return filled


def last_checkpoint(trainer: Namespace) -> Path | None:
    """The newest ``last*.ckpt`` in the ``ModelCheckpoint`` folders of ``trainer``: what ``--ckpt_path last`` loads."""
    folders = [
        Path(spec.init_args.dirpath)
        for spec in _as_list(trainer.get("callbacks"))
        if isinstance(spec, Namespace)
        and _is_subclass(spec.get("class_path", ""), ModelCheckpoint)
        and spec.get("init_args") is not None
        and spec.init_args.get("dirpath")
    ]
    found = [path for folder in folders for path in folder.glob("last*.ckpt") if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def run_folders(loggers: list[Logger]) -> dict[Path, tuple[set[Path], Path]]:
    """Per logger root folder: the folders in it now and its nearest existing ancestor (itself when it exists).

    Taken before a run, for :func:`prune_failed_run`; loggers without a root folder are left out.
    """
    found = {}
    for logger in loggers:
        root = getattr(logger, "root_dir", None)
        if root:
            root = Path(root).absolute()
            kept = root
            while not kept.exists() and kept.parent != kept:
                kept = kept.parent
            found[root] = (set(root.iterdir()) if root.is_dir() else set(), kept)
    return found


def holds_only_setup_files(folder: Path) -> bool:
    """Whether ``folder`` has nothing a user would keep: hparams/config YAML, TensorBoard event files, and a
    ``metrics.csv`` without rows; no sub-folder, checkpoint, evaluation report or other file."""
    for path in folder.iterdir():
        if path.is_dir():
            return False
        if path.name == "metrics.csv":
            with open(path) as handle:
                if sum(1 for line in handle if line.strip()) > 1:
                    return False
        elif path.name not in SETUP_FILES and not path.name.startswith(SETUP_PREFIXES):
            return False
    return True


def prune_failed_run(before: dict[Path, tuple[set[Path], Path]], global_step: int) -> list[Path]:
    """Remove the run folders a failed run created that hold only set-up files (:func:`holds_only_setup_files`).

    Args:
        before: :func:`run_folders` taken before the run started. Only folders created since are removed,
            then the folders above them that the run created and left empty.
        global_step: the trainer's optimizer step when the run failed; a run that took a step keeps its folders.

    Returns:
        The folders removed.
    """
    removed: list[Path] = []
    if global_step > 0:
        return removed
    for root, (existing, kept) in before.items():
        if not root.is_dir():
            continue
        for folder in sorted(set(root.iterdir()) - existing):
            if folder.is_dir() and holds_only_setup_files(folder):
                shutil.rmtree(folder)
                removed.append(folder)
        folder = root
        while folder != kept and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            removed.append(folder)
            folder = folder.parent
    if removed:
        log.info("the failed run logged nothing; removed %s", ", ".join(str(p) for p in removed))
    return removed
