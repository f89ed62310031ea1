"""Model options given with ``--ckpt_path`` that differ from the checkpoint's hyper-parameters.

Lightning's CLI replaces the model options of the config and command line with those saved in the
checkpoint, silently. ``lightning-memrl`` compares them instead: an option that would change what
the checkpoint's weights are (the model id, LoRA, dtype, quantization, the workflow's own modules)
stops the run with one message naming every such option; any other (generation, workflow, reward,
GRPO settings) is applied as given, with a warning that names it and the checkpoint's value.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import Namespace

from lightning_memrl.errors import ConfigError

# option (``init_args`` left out) -> what it decides; it and every option below it are refused
REFUSED = {
    "class_path": "the LightningModule class",
    "model_name_or_path": "which weights the checkpoint holds",
    "revision": "which weights the checkpoint holds",
    "dtype": "the weights' dtype",
    "lora": "which weights exist and train (the LoRA adapters)",
    "quantization": "the base weights' format",
    "seed": "the tiny model's weights and the reference model",
    "workflow.class_path": "the workflow and its trainable modules",
    "workflow.embedder": "the reranker's inputs",
    "workflow.embedding_dim": "the reranker's shape",
    "workflow.embedding_model": "the reranker's inputs",
}
# options that ``fit`` cannot change on resume: the checkpoint's optimizer state (its param groups) replaces them
RESTORED_ON_FIT = {
    "optimizer.lr": "the optimizer's learning rate, restored with its state",
    "optimizer.weight_decay": "the optimizer's weight decay, restored with its state",
    "optimizer.betas": "the optimizer's betas, restored with its state",
    "workflow.reranker_lr": "the reranker's learning rate, restored with the optimizer state",
}


def _plain(value: Any) -> Any:
    return value.as_dict() if isinstance(value, Namespace) else value


def _short(option: str) -> str:
    """``model.init_args.workflow.init_args.max_chunks`` -> ``workflow.max_chunks``."""
    return ".".join(part for part in option.split(".")[1:] if part != "init_args")


def _reason(option: str, table: dict[str, str]) -> str | None:
    short = _short(option)
    return next((why for key, why in table.items() if short == key or short.startswith(key + ".")), None)


def _same(a: Any, b: Any) -> bool:
    """Equal values; a tuple equals the list of its items (YAML has no tuples)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def conflicts(given: Any, stored: Any, prefix: str = "model") -> dict[str, tuple[Any, Any]]:
    """``{option: (checkpoint's value, given value)}`` of the model options where ``given`` and ``stored`` differ.

    Sections are compared key by key; a section on one side and a value on the other (e.g. ``lora`` settings
    against the checkpoint's None) is one difference, named by the section.

    Args:
        given: the ``model`` section parsed from the configs and command line.
        stored: the same section after the checkpoint's hyper-parameters were applied to it.
        prefix: the option name of ``given``.
    """
    given, stored = _plain(given), _plain(stored)
    if isinstance(given, dict) and isinstance(stored, dict):
        found: dict[str, tuple[Any, Any]] = {}
        for key in sorted(set(given) | set(stored), key=str):
            found.update(conflicts(given.get(key), stored.get(key), f"{prefix}.{key}"))
        return found
    return {} if _same(given, stored) else {prefix: (stored, given)}


def check_conflicts(found: dict[str, tuple[Any, Any]], ckpt_path: str, subcommand: str) -> str:
    """Raise :class:`ConfigError` naming the options of ``found`` that cannot differ from the checkpoint.

    Args:
        found: :func:`conflicts`.
        ckpt_path: the checkpoint, for the message.
        subcommand: ``fit`` also refuses :data:`RESTORED_ON_FIT` options.

    Returns:
        The warning for the options that are applied as given ("" when none differ).
    """
    tables = (REFUSED, RESTORED_ON_FIT) if subcommand == "fit" else (REFUSED,)
    refused = {}
    for option in found:
        why = next((r for r in (_reason(option, t) for t in tables) if r), None)
        if why:
            refused[option] = why
    if refused:
        listed = "; ".join(
            f"{option} (checkpoint: {found[option][0]!r}, given: {found[option][1]!r}; it sets {why})"
            for option, why in refused.items()
        )
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: these model options differ from the checkpoint's and cannot change with it: "
            f"{listed}. Drop them (or give the checkpoint's values) to use the checkpoint, or start a new run "
            "without --ckpt_path to change them"
        )
    if not found:
        return ""
    listed = ", ".join(f"{option}={given!r} (checkpoint: {saved!r})" for option, (saved, given) in found.items())
    return f"--ckpt_path {ckpt_path}: applying the given model options that differ from the checkpoint's: {listed}"
