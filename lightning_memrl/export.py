"""``lightning-memrl export CKPT OUT [--merge]``: a training checkpoint as a Hugging Face model folder.

The policy is rebuilt from the checkpoint's hyper-parameters (``model_name_or_path``, ``dtype``,
``lora``, ``quantization``, ``seed``) and its weights loaded (a LoRA checkpoint's base is loaded
from its id, see :mod:`lightning_memrl.adapters`). What OUT holds:

- a LoRA run: the adapter only (peft's ``save_pretrained``: ``adapter_config.json`` naming the base,
  ``adapter_model.safetensors``), loaded with
  ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)``;
- a LoRA run with ``--merge``: the base with the adapter merged in, a plain model folder;
- a full fine-tune: the whole model;

and always the tokenizer, so ``AutoTokenizer.from_pretrained(OUT)`` works and OUT can be passed as
``--model.init_args.model_name_or_path`` (an adapter folder is merged into its base when loaded).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.adapter_files import PREFIX, restore_frozen_base
from lightning_memrl.errors import ConfigError, MemRLError
from lightning_memrl.models import LoraSettings, QuantizationSettings, load_policy, load_tokenizer

CONSOLIDATE = "python -m lightning.pytorch.utilities.consolidate_checkpoint"


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path``, checked to be a training checkpoint of this package.

    Raises:
        ConfigError: no such file, a folder (a sharded checkpoint), unreadable, or no policy weights
            or hyper-parameters; the message names ``path``.
    """
    if path.is_dir():
        raise ConfigError(
            f"{path}: a folder, not a checkpoint file; consolidate a sharded checkpoint into one file first "
            f"({CONSOLIDATE} {path}) and pass {path}.consolidated"
        )
    if not path.is_file():
        raise ConfigError(f"{path}: no such checkpoint; pass a .ckpt file a fit wrote (e.g. its checkpoints/last.ckpt)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for files that are not checkpoints
        raise ConfigError(f"{path}: cannot be read as a checkpoint ({type(err).__name__}: {err})") from err
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not any(k.startswith(PREFIX) for k in state):
        raise ConfigError(f"{path}: not a lightning-memrl training checkpoint (it holds no policy weights)")
    if "model_name_or_path" not in checkpoint.get("hyper_parameters", {}):
        raise ConfigError(f"{path}: not a lightning-memrl training checkpoint (no model_name_or_path hyper-parameter)")
    return checkpoint


def _settings(value: Any, cls: type) -> Any:
    """A dataclass setting as the module got it: None, an instance, or the dict the CLI saved."""
    return cls(**value) if isinstance(value, dict) else value


def load_trained_policy(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The trained policy of the checkpoint at ``path``, its tokenizer and the checkpoint's hyper-parameters.

    Raises:
        ConfigError: the checkpoint is missing or invalid, or its weights do not fit the model its
            hyper-parameters load.
    """
    checkpoint = read_checkpoint(path)
    hp = checkpoint["hyper_parameters"]
    name, lora = hp["model_name_or_path"], _settings(hp.get("lora"), LoraSettings)
    tokenizer = load_tokenizer(name)
    policy = load_policy(
        name,
        tokenizer,
        hp.get("dtype", "float32"),
        lora=lora,
        seed=int(hp.get("seed", 0)),
        quantization=_settings(hp.get("quantization"), QuantizationSettings),
    )
    restore_frozen_base(checkpoint, torch.nn.ModuleDict({"policy": policy}), str(path))
    weights = {k.removeprefix(PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    try:
        policy.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ConfigError(f"{path}: its policy weights do not fit the model {name!r} loads ({err})") from err
    return policy.eval(), tokenizer, hp


def export(ckpt: Path, out: Path, merge: bool = False) -> str:
    """Write the checkpoint ``ckpt``'s policy and tokenizer to the folder ``out``; returns what was written.

    Raises:
        ConfigError: ``out`` is a non-empty folder or a file; ``--merge`` of a full fine-tune or of a 4-bit
            (QLoRA) run; the checkpoint is missing or invalid.
    """
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder; choose a new output folder")
    policy, tokenizer, hp = load_trained_policy(ckpt)
    name, lora = hp["model_name_or_path"], hp.get("lora")
    if merge and lora is None:
        raise ConfigError(f"--merge: {ckpt} is a full fine-tune (no LoRA adapters to merge); export it without --merge")
    if merge and hp.get("quantization") is not None:
        raise ConfigError(
            f"--merge: {ckpt} trained adapters on a 4-bit base, which cannot be saved merged; export the adapter "
            f"without --merge and merge it into the full-precision base {name!r} with peft's merge_and_unload"
        )
    if lora is None:
        written = f"the fine-tuned model (from {name})"
    elif merge:
        policy, written = policy.merge_and_unload(), f"the LoRA adapter merged into its base {name}"
    else:
        policy.peft_config["default"].base_model_name_or_path = name  # the id the run loaded, not a cache path
        written = f"the LoRA adapter of base {name}"
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return written


def main(argv: list[str] | None = None) -> None:
    """Run ``lightning-memrl export CKPT OUT [--merge]``; a user error prints one line and exits with 2."""
    parser = argparse.ArgumentParser(prog="lightning-memrl export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", type=Path, help="a checkpoint a fit wrote (e.g. logs/tiny/checkpoints/last.ckpt)")
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    parser.add_argument("--merge", action="store_true", help="LoRA: save the base with the adapter merged in")
    args = parser.parse_args(argv)
    try:
        written = export(args.ckpt, args.out, args.merge)
    except (MemRLError, FileNotFoundError) as err:  # FileNotFoundError: the base model cannot be found
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {written} and its tokenizer to {args.out}")
