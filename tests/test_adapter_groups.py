"""The update's grouped LoRA layers: peft's outputs and gradients, fewer fp32 copies kept, peft's path where it must."""

from __future__ import annotations

import contextlib
import importlib
import json
import statistics
from pathlib import Path

import pytest
import torch
from helpers import scored_rollouts
from test_module import _data, _module

from lightning_memrl import adapter_groups, learner
from lightning_memrl.models import LoraSettings, load_policy

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _policy(tiny_tokenizer, dtype: str = "bfloat16", dropout: float = 0.0, checkpointing: bool = False):
    torch.manual_seed(0)
    lora = LoraSettings(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False)  # scaling 2, B random
    return load_policy("tiny", tiny_tokenizer, dtype=dtype, lora=lora, gradient_checkpointing=checkpointing)


def _loss_and_grads(policy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy.zero_grad(set_to_none=True)
    logits = policy(input_ids=IDS).logits.float()
    logits.logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _lora_a_calls(policy) -> list[int]:
    calls = [0]
    for name, module in policy.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _relative(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((g.float() - reference[n].float()).norm() / reference[n].float().norm()) for n, g in grads.items()}


def test_grouped_layers_give_peft_outputs_and_gradients_without_peft_adapter_calls(tiny_tokenizer) -> None:
    policy = _policy(tiny_tokenizer).train()
    expected_logits, expected = _loss_and_grads(policy)
    calls = _lora_a_calls(policy)
    with adapter_groups.grouped(policy) as served:
        logits, grads = _loss_and_grads(policy)
    assert served == 7 * 2 and calls[0] == 0  # every adapted layer of both decoder layers, no lora_A forward
    torch.testing.assert_close(logits, expected_logits, atol=0, rtol=0)  # scaling 2: the same sums, bit for bit
    assert grads.keys() == expected.keys() and len(grads) == 2 * 7 * 2
    last_mlp = [n for n in grads if "layers.1.mlp" in n]
    assert len(last_mlp) == 6 and all(torch.equal(grads[n], expected[n]) for n in last_mlp)  # the same local sums
    # Further back the hidden state's gradient differs by bf16 rounding: peft rounds each layer's fp32 input
    # gradient to bf16 before they are summed, a group sums its members' in fp32 and rounds once.
    assert max(_relative(grads, expected).values()) < 0.05
    reference = _policy(tiny_tokenizer).train()
    reference.load_state_dict(policy.state_dict())
    _, exact = _loss_and_grads(reference.float())  # the same weights in fp32
    peft_error, grouped_error = _relative(expected, exact), _relative(grads, exact)
    assert statistics.median(grouped_error.values()) <= 1.1 * statistics.median(peft_error.values())
    assert all("forward" not in vars(m) for m in policy.modules())  # peft's forward back after the block


def test_grouped_siblings_keep_one_fp32_input_per_group(tiny_tokenizer) -> None:
    policy = _policy(tiny_tokenizer).train()
    hidden = policy.get_input_embeddings().weight.shape[1]

    def fp32_inputs_kept() -> int:
        kept = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.float32 and tuple(t.shape) == (IDS.numel(), hidden):  # a linear's flattened input
                kept.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            policy(input_ids=IDS).logits.float().sum()
        return len(set(kept))

    through_peft = fp32_inputs_kept()
    with adapter_groups.grouped(policy):
        grouped = fp32_inputs_kept()
    # per decoder layer: q, k, v, o, gate and up each keep an fp32 copy of a hidden-wide input through peft;
    # grouped: q/k/v one, gate/up one, o one
    assert (through_peft, grouped) == (2 * 6, 2 * 3)


def test_disabled_adapters_dropout_and_fp32_bases_keep_peft(tiny_tokenizer) -> None:
    policy = _policy(tiny_tokenizer).eval()
    with torch.no_grad():
        with policy.disable_adapter():
            base = policy(input_ids=IDS).logits
        with adapter_groups.grouped(policy), policy.disable_adapter():  # the reference pass
            assert torch.equal(policy(input_ids=IDS).logits, base)
    dropping = _policy(tiny_tokenizer, dropout=0.5).train()
    calls = _lora_a_calls(dropping)
    with adapter_groups.grouped(dropping):
        dropping(input_ids=IDS)
    assert calls[0] == 7 * 2  # a dropout that applies: each layer its own mask, through peft
    assert adapter_groups.input_groups(_policy(tiny_tokenizer, dtype="float32")) == []  # nothing cast: peft as is


def test_grouped_layers_under_gradient_checkpointing(tiny_tokenizer) -> None:
    plain, replayed = _policy(tiny_tokenizer).train(), _policy(tiny_tokenizer, checkpointing=True).train()
    with adapter_groups.grouped(plain):
        _, expected = _loss_and_grads(plain)
    with adapter_groups.grouped(replayed):
        _, grads = _loss_and_grads(replayed)  # the replay in backward computes the group's product anew
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_lora_update_benchmark_times_both_paths_on_the_same_work(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    bu, lora_update = importlib.import_module("bench_utils"), importlib.import_module("lora_update")
    monkeypatch.setattr(bu, "RESULTS", tmp_path)
    result = lora_update.main(["--model", "tiny", "--rows", "2", "--tokens", "12", "--repeats", "2", "--threads", "1"])
    assert result == json.loads((tmp_path / "lora_update_tiny.json").read_text())
    peft, grouped = result["sides"]["peft"], result["sides"]["grouped"]
    assert len(peft["s"]) == len(grouped["s"]) == 2 and result["grouped_over_peft"] > 0
    # q/k/v keep one fp32 copy of their input instead of three, gate/up one instead of two: 2 x 3 x [24, 64] fp32
    assert peft["kept"]["fp32_bytes"] - grouped["kept"]["fp32_bytes"] == 2 * 3 * 24 * 64 * 4
    assert peft["kept"]["bytes"] - grouped["kept"]["bytes"] == 2 * 3 * 24 * 64 * 4


def test_the_updates_forward_and_backward_passes_run_grouped(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module()
    module.configure_model()
    tasks = _data()
    tasks.setup()
    torch.manual_seed(0)
    rollouts = scored_rollouts(module, tasks, [1.0, 0.0, 0.5, 0.25])
    inside, entered, passes = [False], [], []
    grouped = adapter_groups.grouped

    @contextlib.contextmanager
    def spy(model):
        entered.append(model)
        inside[0] = True
        with grouped(model) as served:
            yield served
        inside[0] = False

    monkeypatch.setattr(adapter_groups, "grouped", spy)
    plain = module.sequence_logprobs
    module.sequence_logprobs = lambda *a, **k: passes.append(inside[0] or not torch.is_grad_enabled()) or plain(*a, **k)
    module.manual_backward = lambda loss: passes.append(inside[0]) or loss.backward()
    module.optimizers, module.lr_schedulers = (
        (lambda: torch.optim.SGD(module.policy.parameters(), lr=0.0)),
        (lambda: None),
    )
    learner.update(module, rollouts)
    assert entered and all(model is module.policy for model in entered) and passes and all(passes)
