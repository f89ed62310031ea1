"""lora.frozen_adapter_name_or_path: frozen agents generate with a saved LoRA adapter, never trained."""

from __future__ import annotations

import pytest
from helpers import save_random_adapter

from lightning_memrl import GenerationSettings, MemRLModule
from lightning_memrl.adapter_files import drop_frozen_base, restore_frozen_base
from lightning_memrl.models import LoraSettings, load_policy
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow

GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory, tiny_tokenizer):
    return save_random_adapter(tmp_path_factory.mktemp("frozen") / "adapter", tiny_tokenizer, seed=1)


def _greedy(engine, tokenizer) -> tuple[list[int], float]:
    prompt = tokenizer("Memories: m1 Ana has a cat. Question: who has a cat?", add_special_tokens=False)["input_ids"]
    (gen,) = engine.generate([prompt], GREEDY)
    return gen.token_ids, float(gen.logprobs.sum())


def _module(lora: LoraSettings) -> MemRLModule:
    module = MemRLModule(lora=lora, workflow=MemoryR1Workflow(stage="answerer"), dtype="float32")
    module.configure_model()
    module.policy.eval()
    return module


def test_frozen_agents_generate_with_the_saved_adapter_and_the_policy_stays_trainable(saved_adapter, tiny_tokenizer):
    module = _module(LoraSettings(r=4, lora_alpha=8, frozen_adapter_name_or_path=str(saved_adapter)))
    frozen = module.workflow.frozen_engine
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # the loaded adapter never trains
    assert str(saved_adapter) in frozen.description
    alone = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(adapter_name_or_path=str(saved_adapter))).eval()
    expected = _greedy(RolloutEngine(alone, tiny_tokenizer), tiny_tokenizer)
    got = _greedy(frozen, tiny_tokenizer)
    assert got[0] == expected[0] and got[1] == pytest.approx(expected[1], abs=1e-4)  # the saved adapter's model
    base = _greedy(_module(LoraSettings(r=4, lora_alpha=8)).workflow.frozen_engine, tiny_tokenizer)
    assert abs(base[1] - got[1]) > 1e-3  # not the base with adapters disabled (the default)
    assert module.policy.active_adapter == "default"  # switched back after generating
    assert {n for n, p in module.policy.named_parameters() if p.requires_grad} == trainable
    policy_out = _greedy(module.engine, tiny_tokenizer)  # the policy: its own zero-initialised adapter = base
    assert policy_out[1] == pytest.approx(base[1], abs=1e-4)


def test_checkpoint_leaves_the_frozen_adapter_out_and_loading_puts_it_back(saved_adapter):
    module = _module(LoraSettings(r=4, lora_alpha=8, frozen_adapter_name_or_path=str(saved_adapter)))
    checkpoint = {"state_dict": module.state_dict()}
    frozen_keys = [k for k in checkpoint["state_dict"] if ".frozen." in k]
    assert frozen_keys
    drop_frozen_base(module, checkpoint)
    assert not any(".frozen." in k for k in checkpoint["state_dict"])  # re-loaded from its path, not saved
    assert not any(".frozen." in k for k in checkpoint["memrl_adapter_only"]["dropped_keys"])
    restore_frozen_base(checkpoint, module)
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    assert all(k in checkpoint["state_dict"] for k in frozen_keys)


def test_a_missing_frozen_adapter_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="lora.frozen_adapter_name_or_path=.*no peft adapter found"):
        _module(LoraSettings(r=4, frozen_adapter_name_or_path=str(tmp_path / "nothing")))
