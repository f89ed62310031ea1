"""The Memory-SFT stage: prompt tokens masked out of the loss, and a short fit through the real CLI."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from helpers import sft_fit_losses
from locomo_fixture import write_locomo

from lightning_memrl.adapters import LoraSettings
from lightning_memrl.models import build_tiny_tokenizer, load_policy
from lightning_memrl.sft.module import IGNORE_INDEX, collate, completion_loss, tokenize_example
from lightning_memrl.sft.targets import SFTExample
from lightning_memrl.workflows.base import encode_chat_prompt

REPO = Path(__file__).resolve().parents[1]


def test_labels_mask_the_prompt_and_end_with_eos():
    tokenizer = build_tiny_tokenizer()
    example = SFTExample("manage", "New fact: Ben moved.", '{"op": "NOOP"}')
    ids, labels, cut = tokenize_example(example, tokenizer, max_length=512)
    prompt = encode_chat_prompt(example.prompt, tokenizer)
    target = tokenizer(example.target, add_special_tokens=False)["input_ids"]
    assert ids == prompt + target + [tokenizer.eos_token_id] and not cut
    assert labels == [IGNORE_INDEX] * len(prompt) + target + [tokenizer.eos_token_id]
    # a sequence over max_length loses prompt tokens from its start, never target tokens
    ids, labels, cut = tokenize_example(example, tokenizer, max_length=len(target) + 3)
    assert cut and len(ids) == len(target) + 3 and ids[-len(target) - 1 :] == target + [tokenizer.eos_token_id]
    batch, n_cut = collate([example, SFTExample("answer", "Q?", "A")], tokenizer, 512)
    assert n_cut == 0 and batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert (batch["labels"][1][batch["attention_mask"][1] == 0] == IGNORE_INDEX).all()


def test_loss_is_the_cross_entropy_of_the_target_tokens_only():
    # 4 tokens: 2 prompt, 2 target (ids 2 then 1); position t predicts token t+1
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 1]])
    logits = torch.zeros(1, 4, 3)
    logits[0, 1] = torch.tensor([0.0, 0.0, math.log(2.0)])  # p(2) = 2/4
    logits[0, 2] = torch.tensor([0.0, math.log(3.0), 0.0])  # p(1) = 3/5
    expected = -(math.log(2 / 4) + math.log(3 / 5)) / 2
    assert math.isclose(completion_loss(logits, labels).item(), expected, rel_tol=1e-6)
    logits[0, 0] = torch.tensor([9.0, -9.0, 5.0])  # predicts a prompt token: not in the loss
    logits[0, 3] = torch.tensor([9.0, -9.0, 5.0])  # after the last token: nothing to predict
    assert math.isclose(completion_loss(logits, labels).item(), expected, rel_tol=1e-6)


def test_sft_fit_through_the_cli_lowers_the_loss_and_saves_the_adapter(tmp_path):
    data = write_locomo(tmp_path / "data")
    config = REPO / "configs" / "memory_r1" / "sft.yaml"
    args = ["--data.init_args.locomo_path", str(data), "--data.init_args.locomo.max_sessions", "1"]
    args += ["--data.init_args.parts", "[manage]", "--data.init_args.batch_size", "2", "--trainer.max_steps", "3"]
    losses = sft_fit_losses(tmp_path, config, "logs/memory_r1_sft", *args)
    assert len(losses) == 3 and losses[2] < losses[0] - 0.05, losses  # the same 2 manager examples each step
    adapter = tmp_path / "logs/memory_r1_sft/adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert any(adapter.glob("adapter_model.*"))
    # the GRPO stage starts from it: model.init_args.lora.adapter_name_or_path (LoRA B starts at 0; SFT moved it)
    policy = load_policy("tiny", build_tiny_tokenizer(), lora=LoraSettings(adapter_name_or_path=str(adapter)))
    trained_b = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.requires_grad for p in trained_b)
    assert max(float(p.abs().max()) for p in trained_b) > 1e-4
