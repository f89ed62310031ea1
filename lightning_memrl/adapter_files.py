"""LoRA adapters on disk: adapter-only training checkpoints, and exported adapter folders loaded as models.

A LoRA run trains the adapters only; its frozen base is whatever ``model_name_or_path`` (and, for
``tiny``, ``seed``) loads, which the checkpoint's hyper-parameters already name. So a LoRA
checkpoint keeps the trainable tensors and leaves out the base (:func:`drop_frozen_base`) and the
adapters of the frozen agents and of the KL reference (``lora.frozen_adapter_name_or_path``,
``lora.reference_adapter_name_or_path``, re-loaded from their paths); loading
it (resume, ``validate``/``test``/``predict`` with ``--ckpt_path``, ``export``) puts the freshly
loaded base tensors back in before the strict ``load_state_dict`` (:func:`restore_frozen_base`),
after checking that the base loaded now is the one the run trained on. Sharded runs (FSDP,
``ModelParallelStrategy``) keep every tensor: their checkpoints are loaded shard by shard in place.

A folder written by ``lightning-memrl export`` without ``--merge`` (peft's ``adapter_config.json``
and adapter weights, and the tokenizer) is itself a ``model_name_or_path``: its base is loaded and
the adapter merged in (:func:`merge_adapter_folder`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.errors import ConfigError

log = logging.getLogger(__name__)

KEY = "memrl_adapter_only"  # the checkpoint entry: base model, the keys left out, the base's fingerprint
PREFIX = "policy."  # the policy's keys in the module's state dict
ADAPTER_CONFIG = "adapter_config.json"
FROZEN_ADAPTER = "frozen"  # peft name of the adapter lora.frozen_adapter_name_or_path loads
REFERENCE_ADAPTER = "reference"  # peft name of the adapter lora.reference_adapter_name_or_path loads
FIXED_ADAPTERS = (FROZEN_ADAPTER, REFERENCE_ADAPTER)  # never trained, re-loaded from their paths: not saved


def _is_fixed_adapter(key: str) -> bool:
    return any(f".{name}." in key for name in FIXED_ADAPTERS)


def _is_sharded(trainer: Any) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(getattr(trainer, "strategy", None), (FSDPStrategy, ModelParallelStrategy))


def _fingerprint(state: dict[str, torch.Tensor], keys: list[str]) -> dict[str, list[float]]:
    """Sum and absolute sum of the first and the last smallest matrix among ``keys``: cheap, and a
    different base (another model, revision or ``tiny`` seed) changes them."""
    matrices = [k for k in keys if state[k].dim() >= 2]
    if not matrices:
        return {}
    smallest = min(state[k].numel() for k in matrices)
    picked = [k for k in matrices if state[k].numel() == smallest]
    out = {}
    for key in dict.fromkeys([picked[0], picked[-1]]):
        tensor = state[key].detach()
        out[key] = [float(torch.sum(tensor, dtype=torch.float64)), float(tensor.double().abs().sum())]
    return out


def drop_frozen_base(module: Any, checkpoint: dict[str, Any]) -> None:
    """Leave the frozen base weights of a LoRA policy out of ``checkpoint["state_dict"]``.

    What stays: every trainable tensor (the adapters, peft's ``modules_to_save``) and everything
    outside the policy. ``checkpoint["memrl_adapter_only"]`` records the base (``model_name_or_path``,
    ``seed``), the keys left out and a fingerprint of the base, in plain types (the CLI reads
    checkpoints with ``weights_only=True``). A full fine-tune or a sharded run is left as it is.
    """
    if module.lora is None or module.policy is None or _is_sharded(module._trainer):
        return
    state = checkpoint["state_dict"]
    trainable = {PREFIX + n for n, p in module.policy.named_parameters(remove_duplicate=False) if p.requires_grad}
    for key in [k for k in state if _is_fixed_adapter(k)]:  # re-loaded from their paths
        del state[key]
    dropped = [k for k in state if k.startswith(PREFIX) and k not in trainable]
    checkpoint[KEY] = {
        "base_model": module.model_name_or_path,
        "seed": int(module.seed),
        "dropped_keys": dropped,
        "fingerprint": _fingerprint(state, dropped),
    }
    for key in dropped:
        del state[key]


def restore_frozen_base(checkpoint: dict[str, Any], module: torch.nn.Module, source: str | None = None) -> None:
    """Put the base weights that :func:`drop_frozen_base` left out back into ``checkpoint["state_dict"]``.

    Args:
        checkpoint: the loaded checkpoint (changed in place; nothing happens without its ``memrl_adapter_only``).
        module: the module that will load it (its policy under ``policy``), whose base was just loaded.
        source: the checkpoint's path, as errors name it.

    Raises:
        ConfigError: the base loaded now lacks some of the left-out tensors or has other weights.
    """
    info = checkpoint.get(KEY)
    if not info:
        return
    live_state, source = module.state_dict(), source or "the checkpoint"
    keys = list(info["dropped_keys"])
    missing = [k for k in keys if k not in live_state]
    base = f"{info['base_model']!r}" + (f" (seed {info['seed']})" if info["base_model"] == "tiny" else "")
    if missing:
        raise ConfigError(
            f"{source}: a LoRA checkpoint holds the adapters only and is loaded onto its base {base}, but the model "
            f"loaded now lacks {len(missing)} of the base's tensors (e.g. {missing[0]}): load it with the "
            "model_name_or_path, lora and quantization options it was trained with"
        )
    for key, (total, scale) in info.get("fingerprint", {}).items():
        now = live_state[key].detach()
        if abs(float(torch.sum(now, dtype=torch.float64)) - total) > 1e-5 * max(scale, 1e-12):
            raise ConfigError(
                f"{source}: a LoRA checkpoint holds the adapters only; its base {base} loads with other weights "
                f"now ({key} differs), so the adapters would run on another model. Load the base it was trained "
                "on (the same model folder or hub revision, and seed for tiny)"
            )
    state = checkpoint["state_dict"]
    for key in keys:
        state[key] = live_state[key]
    for key in [k for k in live_state if _is_fixed_adapter(k)]:  # frozen agents' / reference adapter, from their paths
        state[key] = live_state[key]


# --------------------------------------------------------------------------- exported adapter folders
def adapter_base(name_or_path: str) -> str | None:
    """The base model of a peft adapter folder (one with ``adapter_config.json``), or None for anything else."""
    config = Path(name_or_path) / ADAPTER_CONFIG
    if not config.is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"model.init_args.model_name_or_path={name_or_path!r}: {config} names no base_model_name_or_path; "
            "set it to the hub id or folder of the model the adapter was trained on"
        )
    return base


def merge_adapter_folder(name_or_path: str, base_model: Any) -> Any:
    """``base_model`` with the adapter of the folder ``name_or_path`` merged into its weights (a plain model)."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base_model, name_or_path).merge_and_unload()
    log.info("model_name_or_path %s is a LoRA adapter: merged into its base", name_or_path)
    return merged


def check_adapter_loading(name_or_path: str, quantization: Any, empty_weights: bool) -> None:
    """Refuse what an adapter folder cannot be loaded with: 4-bit base weights, or sharded (empty) loading."""
    why = "quantization" if quantization is not None else "sharded loading" if empty_weights else None
    if why:
        raise ConfigError(
            f"model.init_args.model_name_or_path={name_or_path!r} is a LoRA adapter folder, which is loaded by "
            f"merging it into its base; {why} needs a full model: export it with `lightning-memrl export CKPT OUT "
            "--merge` and pass OUT"
        )
