"""lora.reference_adapter_name_or_path: the KL term's reference is a saved LoRA adapter (e.g. the SFT warm start)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import AnswerLength, quiet_trainer, save_random_adapter

from lightning_memrl import GenerationSettings, GRPOSettings, MemRLModule, OptimizerSettings
from lightning_memrl.adapter_files import drop_frozen_base, restore_frozen_base
from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.synthetic import SyntheticTaskSettings
from lightning_memrl.models import LoraSettings, load_policy
from lightning_memrl.workflows.memagent import MemAgentWorkflow

IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory, tiny_tokenizer):
    return save_random_adapter(tmp_path_factory.mktemp("reference") / "adapter", tiny_tokenizer, seed=2)


def _module(kl_coef: float = 0.1, **lora) -> MemRLModule:
    module = MemRLModule(
        lora=LoraSettings(r=4, lora_alpha=8, **lora),
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, kl_coef=kl_coef),
        optimizer=OptimizerSettings(lr=1e-3),
        dtype="float32",
    )
    module.configure_model()
    return module


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def test_the_reference_computes_with_the_saved_adapter_and_the_policy_stays_as_it_was(saved_adapter, tiny_tokenizer):
    module = _module(reference_adapter_name_or_path=str(saved_adapter))
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # the reference adapter never trains
    alone = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(adapter_name_or_path=str(saved_adapter)))
    with module.reference_context():
        reference = _logits(module.policy)
    torch.testing.assert_close(reference, _logits(alone), atol=1e-5, rtol=0)
    with module.policy.disable_adapter():
        base = _logits(module.policy)
    assert (reference - base).abs().max() > 1e-3  # not the base with adapters disabled (the default)
    torch.testing.assert_close(_logits(module.policy), base)  # the policy: its zero-initialised adapter
    assert module.policy.active_adapter == "default"
    assert {n for n, p in module.policy.named_parameters() if p.requires_grad} == trainable


def _first_step_kl(tmp_path, module: MemRLModule) -> float:
    data = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=4, sentences_per_chunk=1))
    trainer = quiet_trainer(tmp_path, steps=1)
    trainer.fit(module, data)
    return float(trainer.callback_metrics["train/kl"])


def test_a_policy_that_starts_from_the_reference_adapter_has_zero_kl_at_the_first_step(saved_adapter, tmp_path):
    torch.manual_seed(0)
    start = {"adapter_name_or_path": str(saved_adapter)}
    anchored = _first_step_kl(tmp_path / "a", _module(reference_adapter_name_or_path=str(saved_adapter), **start))
    torch.manual_seed(0)
    to_base = _first_step_kl(tmp_path / "b", _module(**start))
    assert abs(anchored) < 1e-6  # the policy before its first update is the warm start itself
    assert to_base > 1e-3  # the default reference, the base, is another model


def test_checkpoints_leave_the_reference_adapter_out_and_loading_puts_it_back(saved_adapter):
    module = _module(reference_adapter_name_or_path=str(saved_adapter))
    checkpoint = {"state_dict": module.state_dict()}
    reference_keys = [k for k in checkpoint["state_dict"] if ".reference." in k]
    assert reference_keys
    drop_frozen_base(module, checkpoint)
    assert not any(".reference." in k for k in checkpoint["state_dict"])  # re-loaded from its path
    assert not any(".reference." in k for k in checkpoint["memrl_adapter_only"]["dropped_keys"])
    restore_frozen_base(checkpoint, module)
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    assert all(k in checkpoint["state_dict"] for k in reference_keys)


def test_without_a_kl_term_the_reference_adapter_is_not_loaded_and_a_warning_says_why(saved_adapter, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_memrl.rollout.frozen"):
        module = _module(kl_coef=0.0, reference_adapter_name_or_path=str(saved_adapter))
    assert "reference" not in module.policy.peft_config
    assert "reference_adapter_name_or_path" in caplog.text and "grpo.kl_coef is 0" in caplog.text


def test_a_missing_reference_adapter_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="lora.reference_adapter_name_or_path=.*no peft adapter found"):
        _module(reference_adapter_name_or_path=str(tmp_path / "nothing"))
