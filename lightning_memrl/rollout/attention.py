"""Decode-step attention on CPU in bf16/fp16: a key/value head's query heads as rows of one product.

With grouped-query attention (SmolLM2-135M: 9 query heads over 3 key/value heads) and one new token
per row, ``transformers``' ``sdpa`` passes ``enable_gqa=True`` to ``scaled_dot_product_attention``
when the step has no attention mask (no row is padded), and there PyTorch's CPU kernel computes each
query head as its own one-row product. In bf16 that runs 5-8x slower than the same attention with the
query heads of each key/value head folded into rows (``[B, H, 1, D]`` viewed as ``[B, H_kv, H/H_kv, D]``):
at a batch of 8, 620 cached positions and 2 threads, 2.6-2.9 ms against 0.38 ms per call, on a 2-core
AVX512-BF16 CPU (in fp32 the two are equally fast). A step with a mask (some row is padded) already
gets the folded form from ``transformers`` (``pack_gqa``); the unmasked case is a batch whose prompts
are all as long: one prompt sampled G times (a GRPO group), or one MemAgent task's group.

Same attention, not the same bits: the kernel computes the same products, softmax and sums per query
row, in fp32, but not always in the same order for 3 query rows as for 1, so an output may move by
one bf16 rounding step (SmolLM2, 8 rows over 601 positions: 69 of 240 decode calls differed, by at
most 0.004). bf16 rollouts never match the update's full-sequence forward anyway; the gap between the
rollout's and the update's log-probs of the sampled tokens stayed where it was (mean 0.050 with
``sdpa``, 0.050 folded, 384 tokens).

:func:`folded_decode_attention` is that attention, registered with ``transformers``'
``AttentionInterface`` (and ``sdpa``'s mask function) as :data:`FOLDED_DECODE_SDPA`. Every call it
does not serve (a prompt's prefill, the update's forward, fp32, another device, a per-head mask,
dropout, softcapping, attention weights asked for) goes to ``sdpa`` unchanged. :func:`decode_attention`
switches a model that runs ``sdpa`` to it for the duration of a rollout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

FOLDED_DECODE_SDPA = "memrl_folded_decode_sdpa"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def folded_decode_attention(
    module: torch.nn.Module,
    query: Tensor,  # [B, H, T, D]
    key: Tensor,  # [B, H_kv, S, D]
    value: Tensor,  # [B, H_kv, S, D]
    attention_mask: Tensor | None,  # None, or [B | 1, 1 | H, T, S]
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``sdpa`` attention, with a CPU bf16/fp16 decode step's query heads folded into rows of their key/value head.

    Returns:
        The attention output ``[B, T, H, D]`` and None (no attention weights), as ``sdpa_attention_forward``.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if not _folds(query, groups, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, _, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups, dim)  # [B, H_kv, G, D]: one row per query head
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None  # [B, 1, H, D]


def _folds(query: Tensor, groups: int, mask: Tensor | None, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether a call is a decode step the folded product serves (one query per row, one mask for all heads)."""
    if query.shape[2] != 1 or groups <= 1 or query.device.type != "cpu" or query.dtype not in _LOW_PRECISION:
        return False
    if dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return False
    if kwargs.get("output_attentions") or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        return False
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)  # one mask for all heads


def register() -> None:
    """Make :data:`FOLDED_DECODE_SDPA` a valid ``attn_implementation`` (with ``sdpa``'s masks); idempotent."""
    AttentionInterface.register(FOLDED_DECODE_SDPA, folded_decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FOLDED_DECODE_SDPA, sdpa_mask)


@contextmanager
def decode_attention(model: Any) -> Iterator[bool]:
    """Inside: a model that runs ``sdpa`` runs :func:`folded_decode_attention` (yields whether it switched).

    The model's config (shared by a peft wrapper and its base model) names the attention function each
    forward looks up, so the switch is undone on the way out, also after an error.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield False
        return
    register()
    config._attn_implementation = FOLDED_DECODE_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"
