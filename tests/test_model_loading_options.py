"""from_pretrained options: revision and trust_remote_code (model and tokenizer), and 8-bit base weights."""

from __future__ import annotations

import json
import math
import shutil

import huggingface_hub.constants
import pytest
import torch
from helpers import AnswerLength, quiet_trainer

from lightning_memrl import (
    ConfigError,
    GenerationSettings,
    GRPOSettings,
    LoraSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
)
from lightning_memrl.models import QuantizationSettings, build_tiny_model, load_policy, load_tokenizer

CUSTOM_CODE = """from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


class CustomConfig(LlamaConfig):
    model_type = "custom_llama"


class CustomLlama(LlamaForCausalLM):
    config_class = CustomConfig


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny_model")
    build_tiny_model(tiny_tokenizer, seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _edit_json(path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


@pytest.fixture()
def custom_code_model(saved_tiny, tmp_path):
    """The tiny model as a repository with its own code: a config, model and tokenizer class of its own."""
    path = tmp_path / "custom"
    shutil.copytree(saved_tiny, path)
    (path / "custom_llama.py").write_text(CUSTOM_CODE)
    auto = {"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomLlama"}
    _edit_json(path / "config.json", model_type="custom_llama", auto_map=auto)
    _edit_json(
        path / "tokenizer_config.json",
        tokenizer_class="CustomTokenizer",
        auto_map={"AutoTokenizer": [None, "custom_llama.CustomTokenizer"]},
    )
    return str(path)


def test_trust_remote_code_reaches_model_and_tokenizer(custom_code_model, tiny_tokenizer):
    with pytest.raises(ConfigError, match="runs code from its own repository.*set model.init_args.trust_remote_code"):
        load_policy(custom_code_model, tiny_tokenizer)
    with pytest.raises(ConfigError, match="set model.init_args.trust_remote_code: true"):
        load_tokenizer(custom_code_model)
    model = load_policy(custom_code_model, tiny_tokenizer, trust_remote_code=True)
    tokenizer = load_tokenizer(custom_code_model, trust_remote_code=True)
    assert type(model).__name__ == "CustomLlama" and type(tokenizer).__name__ == "CustomTokenizer"
    assert tokenizer("Alice")["input_ids"] == tiny_tokenizer("Alice")["input_ids"]
    module = MemRLModule(custom_code_model, trust_remote_code=True)  # the module's option reaches both
    module.configure_model()
    assert type(module.policy).__name__ == "CustomLlama" and type(module.tokenizer).__name__ == "CustomTokenizer"


@pytest.fixture()
def hub_cache(saved_tiny, tiny_tokenizer, tmp_path, monkeypatch):
    """An offline Hugging Face cache holding ``local/tiny`` at two revisions: ``main`` (seed 0) and ``v1`` (seed 1)."""
    repo = tmp_path / "hub" / "models--local--tiny"
    for ref, commit, seed in (("main", "a" * 40, 0), ("v1", "b" * 40, 1)):
        snapshot = repo / "snapshots" / commit
        build_tiny_model(tiny_tokenizer, seed=seed).save_pretrained(snapshot)
        tiny_tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return "local/tiny"


def test_revision_selects_the_hub_snapshot(hub_cache, tiny_tokenizer):
    def first_weight(revision):
        model = load_policy(hub_cache, load_tokenizer(hub_cache, revision=revision), revision=revision)
        return model.model.embed_tokens.weight

    expected = {seed: build_tiny_model(tiny_tokenizer, seed=seed).model.embed_tokens.weight for seed in (0, 1)}
    assert torch.equal(first_weight(None), expected[0])
    assert torch.equal(first_weight("v1"), expected[1])
    with pytest.raises(FileNotFoundError, match="model_name_or_path='local/tiny': no model found"):
        load_policy(hub_cache, tiny_tokenizer, revision="v2")


def test_revision_of_a_local_folder_or_tiny_is_refused(saved_tiny, tiny_tokenizer):
    with pytest.raises(ConfigError, match="revision='v1' selects a branch, tag or commit .* is a local folder"):
        load_policy(str(saved_tiny), tiny_tokenizer, revision="v1")
    with pytest.raises(ConfigError, match="is the built-in tiny model"):
        load_tokenizer("tiny", revision="v1")


def test_8bit_settings():
    eight = QuantizationSettings(load_in_8bit=True)
    assert (eight.load_in_4bit, eight.bits) == (False, 8)
    bnb = eight.to_bnb_config()
    assert bnb.load_in_8bit and not bnb.load_in_4bit
    assert QuantizationSettings().bits == 4 and QuantizationSettings().to_bnb_config().load_in_4bit
    with pytest.raises(ConfigError, match="load_in_4bit=True and load_in_8bit=True: choose one"):
        QuantizationSettings(load_in_4bit=True, load_in_8bit=True)


def test_8bit_base_trains_adapters_and_stays_frozen(saved_tiny, tmp_path):
    from bitsandbytes.nn import Linear8bitLt

    module = MemRLModule(
        str(saved_tiny),
        lora=LoraSettings(r=4, lora_alpha=8),
        quantization=QuantizationSettings(load_in_8bit=True),
        workflow=MemAgentWorkflow(max_memory_tokens=4, max_chunks=2),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=4),
        grpo=GRPOSettings(group_size=2),
        optimizer=OptimizerSettings(lr=1e-2),
    )
    module.configure_model()
    layers = [m for m in module.policy.modules() if isinstance(m, Linear8bitLt)]
    assert len(layers) == 14 and all(m.weight.dtype == torch.int8 for m in layers)  # 7 projections x 2 layers
    base_before = [m.weight.detach().clone() for m in layers]
    adapters_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters_before and all("lora_" in n for n in adapters_before)
    data = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=4, sentences_per_chunk=1))
    trainer = quiet_trainer(tmp_path, steps=1)
    trainer.fit(module, data)
    assert math.isfinite(float(trainer.logged_metrics["train/loss"]))
    after = dict(module.policy.named_parameters())
    assert any(not torch.equal(adapters_before[n], after[n]) for n in adapters_before)
    assert all(torch.equal(m.weight, before) for m, before in zip(layers, base_before))  # the int8 base is frozen
