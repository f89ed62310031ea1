"""Lean decode steps of Llama decoder layers: the same rollouts bit for bit, served only where they apply."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama as llama

from lightning_memrl import LoraSettings
from lightning_memrl.models import build_tiny_model, load_policy
from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.lean_layers import lean_decode
from lightning_memrl.settings import GenerationSettings

PREFIX = list(range(5, 40))
PROMPTS = [PREFIX + [50 + row] * (row + 1) for row in range(4)]  # a shared prefix, then rows of other lengths


@pytest.fixture()
def layer_calls(monkeypatch):
    """How many times the layers' own forward ran."""
    calls = {"n": 0}
    own = llama.LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return own(self, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", counted)
    return calls


def _runs(make_engine, model, tokenizer, settings, calls=None):
    """The same rollout with the lean path off and on (and the layers' own forward calls of each)."""
    runs, counts = [], []
    for lean in (False, True):
        torch.manual_seed(5)
        before = calls["n"] if calls else 0
        engine = make_engine(model, tokenizer, lean_decode_layers=lean)
        runs.append(engine.generate(PROMPTS, settings))
        counts.append((calls["n"] if calls else 0) - before)
    return runs, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollouts_are_bit_for_bit_the_same(tiny_tokenizer, layer_calls, dtype, temperature):
    model = build_tiny_model(tiny_tokenizer, seed=0, dtype=dtype).eval()
    settings = GenerationSettings(temperature=temperature, max_new_tokens=8)
    (off, on), (calls_off, calls_on) = _runs(RolloutEngine, model, tiny_tokenizer, settings, layer_calls)
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    layers = model.config.num_hidden_layers
    assert calls_on == 2 * layers  # the shared prefix's prefill and the rows' own: the decode steps were lean
    assert calls_off == calls_on + 7 * layers  # 8 new tokens: 7 decode forwards after the prefill


def test_lora_and_the_decode_loop_backend_are_the_same(tiny_tokenizer):
    lora = LoraSettings(r=4, lora_alpha=8, init_lora_weights="gaussian")
    model = load_policy("tiny", tiny_tokenizer, lora=lora).eval()
    settings = GenerationSettings(temperature=1.0, max_new_tokens=8)
    for make_engine in (RolloutEngine, DecodeLoopEngine):
        (off, on), _ = _runs(make_engine, model, tiny_tokenizer, settings)
        for a, b in zip(off, on):
            assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_only_decode_steps_without_gradients_take_the_lean_path(tiny_model, layer_calls):
    ids = torch.tensor([[5, 6, 7, 8]])
    with lean_decode(tiny_model) as served:
        assert served == tiny_model.config.num_hidden_layers
        out = tiny_model(input_ids=ids, use_cache=True)  # a prefill: the layers' own forward
        assert layer_calls["n"] == served
        with torch.no_grad():
            tiny_model(input_ids=ids[:, :1], cache=out.past_key_values, use_cache=True)  # a decode step
        assert layer_calls["n"] == served
        tiny_model(input_ids=ids[:, :1], cache=out.past_key_values, use_cache=True)  # gradients on: their own
        assert layer_calls["n"] == 2 * served


def test_layers_get_their_forward_back_also_after_an_error(tiny_model):
    layers = list(tiny_model.model.layers)
    with pytest.raises(RuntimeError, match="boom"), lean_decode(tiny_model):
        assert all("forward" in layer.__dict__ for layer in layers)
        raise RuntimeError("boom")
    assert not any("forward" in layer.__dict__ for layer in layers)


def test_other_layer_classes_are_left_alone(tiny_model):
    class Custom(llama.LlamaDecoderLayer):
        pass

    tiny_model.model.layers[0].__class__ = Custom  # a subclass may compute something else
    with lean_decode(tiny_model) as served:
        assert served == tiny_model.config.num_hidden_layers - 1
        assert "forward" not in tiny_model.model.layers[0].__dict__
