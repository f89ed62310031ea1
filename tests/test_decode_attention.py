"""Folded decode-step attention: the same attention as ``sdpa``, used by rollouts only, undone after them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout import attention
from lightning_memrl.rollout.attention import FOLDED_DECODE_SDPA, decode_attention, folded_decode_attention
from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings


class _Gqa(torch.nn.Module):
    num_key_value_groups = 3  # 6 query heads over 2 key/value heads
    is_causal = True


def _inputs(dtype: torch.dtype, q_len: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(4, 6, q_len, 16, generator=gen).to(dtype)  # [B, H, T, D]
    key = torch.randn(4, 2, 40, 16, generator=gen).to(dtype)  # [B, H_kv, S, D]
    value = torch.randn(4, 2, 40, 16, generator=gen).to(dtype)
    return query, key, value


@pytest.fixture()
def sdpa_queries(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shapes ``scaled_dot_product_attention`` is called with."""
    shapes: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append(tuple(query.shape))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return shapes


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_decode_step_folds_query_heads_into_rows_and_matches_sdpa(sdpa_queries, masked: bool) -> None:
    query, key, value = _inputs(torch.bfloat16)
    mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :7] = False  # a left-padded row
    mask = mask if masked else None
    out, weights = folded_decode_attention(_Gqa(), query, key, value, mask, scaling=0.25)
    assert weights is None and sdpa_queries == [(4, 2, 3, 16)]  # one call, 3 query rows per key/value head
    ref, _ = sdpa_attention_forward(_Gqa(), query, key, value, mask, scaling=0.25)
    exact, _ = sdpa_attention_forward(_Gqa(), query.float(), key.float(), value.float(), mask, scaling=0.25)
    assert out.shape == ref.shape == (4, 1, 6, 16) and out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max() <= 2**-6  # at most a rounding step of values below 2 apart
    assert (out.float() - exact).abs().max() <= 2**-6  # and as close to the fp32 attention as sdpa's own


@pytest.mark.parametrize(
    ("dtype", "q_len", "mask_heads"),
    [(torch.float32, 1, 1), (torch.bfloat16, 5, 1), (torch.bfloat16, 1, 6)],
    ids=["fp32", "prefill", "per-head-mask"],
)
def test_calls_it_does_not_serve_go_to_sdpa(monkeypatch, dtype, q_len: int, mask_heads: int) -> None:
    delegated = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: delegated.append(a) or (a[1], None))
    query, key, value = _inputs(dtype, q_len)
    mask = torch.ones(4, mask_heads, q_len, 40, dtype=torch.bool).tril(diagonal=40 - q_len)
    out, _ = folded_decode_attention(_Gqa(), query, key, value, mask, scaling=0.25)
    assert len(delegated) == 1 and out is query  # handed to sdpa as it came


def _bf16_model(tiny_tokenizer):
    torch.manual_seed(0)
    model = build_tiny_model(tiny_tokenizer, seed=0, dtype=torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture()
def folded_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(attention implementation, query length) of every call of the registered folded attention."""
    seen: list[tuple[str, int]] = []

    def spy(module, query, *args, **kwargs):
        seen.append((module.config._attn_implementation, query.shape[2]))
        return folded_decode_attention(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "folded_decode_attention", spy)  # what register() puts in the interface
    yield seen
    monkeypatch.undo()
    attention.register()  # the real function again


@pytest.mark.parametrize("engine_class", [RolloutEngine, DecodeLoopEngine])
def test_rollout_engines_fold_bf16_decode_steps_and_give_sdpa_back(tiny_tokenizer, engine_class, folded_calls) -> None:
    model = _bf16_model(tiny_tokenizer)
    seen = folded_calls
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10], [11, 12, 13, 14, 15]]
    settings = GenerationSettings(temperature=0.0, max_new_tokens=6)
    gens = engine_class(model, tiny_tokenizer, share_prefixes=False).generate(prompts, settings)
    assert model.config._attn_implementation == "sdpa"  # given back
    decode_steps = max(len(g.token_ids) for g in gens) - 1
    assert seen and all(name == FOLDED_DECODE_SDPA for name, _ in seen)
    assert sum(q_len == 1 for _, q_len in seen) >= decode_steps * model.config.num_hidden_layers
    seen.clear()
    off = engine_class(model, tiny_tokenizer, share_prefixes=False, fold_decode_attention=False)
    off.generate(prompts, settings)
    assert not seen  # sdpa itself


def test_switch_is_undone_after_an_error_and_skips_other_attention(tiny_tokenizer) -> None:
    model = _bf16_model(tiny_tokenizer)
    with pytest.raises(RuntimeError, match="boom"), decode_attention(model) as switched:
        assert switched and model.config._attn_implementation == FOLDED_DECODE_SDPA
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with decode_attention(model) as switched:
        assert not switched and model.config._attn_implementation == "eager"


def test_folded_rollout_logprobs_are_as_close_to_the_update_as_sdpa(tiny_tokenizer) -> None:
    """bf16 rollouts never equal the update's full-sequence forward; folding must not widen that gap."""
    model = _bf16_model(tiny_tokenizer)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)]
    settings = GenerationSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12)
    gaps = {}
    for fold in (False, True):
        torch.manual_seed(3)
        gens = RolloutEngine(model, tiny_tokenizer, share_prefixes=False, fold_decode_attention=fold).generate(
            prompts, settings
        )
        gap = []
        with torch.no_grad():
            for prompt, gen in zip(prompts, gens):
                ids = torch.tensor([prompt + gen.token_ids])
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [S, V]
                update = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
                gap.append((update - gen.logprobs).abs().max())
        gaps[fold] = float(torch.stack(gap).max())
    assert gaps[True] <= 2 * gaps[False] + 0.02, gaps
