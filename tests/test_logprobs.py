"""Selective, chunked log-probs equal the full-vocabulary computation (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl import MemRLModule
from lightning_memrl.logprobs import head_logprobs, selected_logprobs, split_head
from lightning_memrl.losses import entropy_from_logits
from lightning_memrl.models import LoraSettings


def test_selected_logprobs_match_log_softmax() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    ids = torch.tensor([0, 2])
    expected = torch.log_softmax(logits / 0.5, -1)[torch.arange(2), ids]
    torch.testing.assert_close(selected_logprobs(logits, ids, 0.5), expected)
    # hand-computed: row 0 at T=1 is 2 - log(e^2 + 1 + e^-1)
    assert selected_logprobs(logits, ids)[0].item() == pytest.approx(
        2 - torch.tensor([2.0, 0.0, -1.0]).exp().sum().log().item()
    )


@pytest.mark.parametrize("chunk_tokens", [1, 3, 1024])
def test_head_logprobs_equal_full_logits_with_gradients(chunk_tokens: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    full_logits = head(hidden) / 0.7
    expected = torch.log_softmax(full_logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    expected_entropy = entropy_from_logits(full_logits)
    (expected.sum() + expected_entropy.sum()).backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    logprobs, entropy = head_logprobs(hidden, head, ids, 0.7, with_entropy=True, chunk_tokens=chunk_tokens)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)
    (logprobs.sum() + entropy.sum()).backward()
    torch.testing.assert_close(hidden.grad, grads[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(head.weight.grad, grads[1], atol=1e-5, rtol=0)


def test_head_logprobs_metric_entropy_has_no_graph_and_same_values() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    logprobs, entropy = head_logprobs(hidden, head, ids, 0.7, with_entropy=True, chunk_tokens=3)
    lp_metric, entropy_metric = head_logprobs(
        hidden, head, ids, 0.7, with_entropy=True, chunk_tokens=3, entropy_grad=False
    )
    assert entropy.requires_grad and not entropy_metric.requires_grad
    assert lp_metric.requires_grad  # the log-probs still train
    torch.testing.assert_close(entropy_metric, entropy.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(lp_metric, logprobs, atol=0, rtol=0)


def _module(lora: LoraSettings | None) -> MemRLModule:
    module = MemRLModule("tiny", lora=lora)
    module.configure_model()
    return module


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_sequence_logprobs_split_head_equals_model_forward(lora: LoraSettings | None) -> None:
    module = _module(lora)
    model = module.policy
    assert split_head(model) is not None
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    response = torch.tensor([[13, 14, 15], [16, 17, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logprobs, entropy = module.sequence_logprobs(model, prompts, response, mask, with_entropy=True)
    # the same rows scored one by one from the model's own full logits
    temperature = module.generation.temperature
    for row, prompt in enumerate(prompts):
        n = int(mask[row].sum())
        ids = torch.tensor([prompt + response[row, :n].tolist()])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, response[row, :n].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logprobs[row, :n], expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(entropy[row, :n], entropy_from_logits(logits), atol=1e-4, rtol=0)
    assert logprobs.requires_grad and not entropy.requires_grad  # entropy_coef 0: a metric only


def test_split_head_declines_an_adapted_head() -> None:
    module = _module(LoraSettings(r=4, alpha=8, target_modules=["q_proj", "lm_head"]))
    assert split_head(module.policy) is None  # falls back to the model's logits
    prompts, response, mask = [[5, 6, 7]], torch.tensor([[13, 14]]), torch.tensor([[1, 1]])
    logprobs, _ = module.sequence_logprobs(module.policy, prompts, response, mask)
    assert logprobs.shape == (1, 2) and torch.isfinite(logprobs).all()
