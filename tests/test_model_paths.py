"""Where the default model loads from offline: the converted fp32 copy, and a copy cast once to the load dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from lightning_memrl import model_paths
from lightning_memrl.model_paths import DEFAULT_MODEL, converted_dir, resolve_model_path
from lightning_memrl.models import build_tiny_model, load_policy


@pytest.fixture
def converted_cache(tmp_path, monkeypatch, tiny_tokenizer):
    """A converted-model cache holding a tiny fp32 model as the default model's converted copy."""
    monkeypatch.setenv("LIGHTNING_MEMRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_paths, "_hf_cached_snapshot", lambda hub_id, revision=None: None)
    fp32_dir = converted_dir()
    build_tiny_model(tiny_tokenizer, seed=0).save_pretrained(fp32_dir)
    tiny_tokenizer.save_pretrained(fp32_dir)
    return fp32_dir


def _saved_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_fp32_loads_the_converted_copy_and_bf16_a_copy_cast_once(converted_cache):
    assert resolve_model_path(DEFAULT_MODEL) == str(converted_cache)
    bf16_dir = converted_dir(torch.bfloat16)
    assert bf16_dir.name.endswith("-bfloat16") and not bf16_dir.exists()

    assert resolve_model_path(DEFAULT_MODEL, dtype=torch.bfloat16) == str(bf16_dir)
    fp32, bf16 = _saved_tensors(converted_cache), _saved_tensors(bf16_dir)
    assert fp32.keys() == bf16.keys()
    for name, weight in fp32.items():
        assert weight.dtype == torch.float32 and bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], weight.to(torch.bfloat16)), name
    assert (bf16_dir / "tokenizer.json").is_file() and not bf16_dir.with_name(bf16_dir.name + ".partial").exists()

    written = (bf16_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(DEFAULT_MODEL, dtype=torch.bfloat16) == str(bf16_dir)
    assert (bf16_dir / "model.safetensors").stat().st_mtime_ns == written  # cast once, then reused


def test_a_bf16_policy_is_the_same_model_from_either_copy(converted_cache, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    policy = load_policy(DEFAULT_MODEL, tiny_tokenizer, dtype="bfloat16")
    assert policy.config._name_or_path == str(converted_dir(torch.bfloat16))
    direct = AutoModelForCausalLM.from_pretrained(converted_cache, dtype=torch.bfloat16)
    loaded, expected = policy.state_dict(), direct.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], expected[k]) for k in expected)


def test_without_a_converted_copy_or_package_the_hub_id_is_returned(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_MEMRL_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(model_paths, "_hf_cached_snapshot", lambda hub_id, revision=None: None)
    monkeypatch.setattr(model_paths, "_gguf_package_dir", lambda: None)
    assert resolve_model_path(DEFAULT_MODEL, dtype=torch.bfloat16) == DEFAULT_MODEL
    assert not (tmp_path / "empty").exists()
