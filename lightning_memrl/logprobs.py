"""Selective log-probs: score only the generated tokens, a chunk of positions at a time.

A full-vocabulary fp32 ``[B, R, V]`` tensor (49k vocabulary: 200 KB per position) is what makes
RL trainers run out of memory. Here the LM head runs on ``chunk_tokens`` positions at a time,
and under autograd each chunk is recomputed in the backward pass instead of being kept, so at
most one chunk's ``[chunk_tokens, V]`` logits exist at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def selected_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs of ``token_ids`` under ``logits / temperature``, computed in fp32.

    Args:
        logits: raw scores, any dtype.  # [..., V]
        token_ids: the tokens to score.  # [...]
        temperature: divides the logits (the sampler's temperature; 1 when greedy).

    Returns:
        fp32 log-probs.  # [...]
    """
    logits = logits.float() / temperature
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_scores(
    hidden: Tensor,  # [n, H]
    weight: Tensor,  # [V, H]
    bias: Tensor | None,  # [V]
    token_ids: Tensor,  # [n]
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight, bias).float()  # [n, V] fp32, one chunk only
    if temperature != 1.0:
        logits.div_(temperature)  # in place: linear's backward does not need its output
    lse = torch.logsumexp(logits, dim=-1)  # [n]
    logprobs = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse
    replay = torch._C._current_graph_task_id() != -1  # a checkpoint recomputing this chunk in backward
    if not with_entropy or (replay and not entropy_grad):  # a logged-only entropy is not needed by backward
        return logprobs, logprobs.new_zeros(())
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # a metric needs no graph
        probs = torch.softmax(logits, dim=-1)  # [n, V]
        expected_logit = torch.bmm(probs.unsqueeze(1), logits.unsqueeze(2)).view(-1)  # E_p[logit], no [n, V] product
        entropy = lse - expected_logit  # H = logsumexp - E_p[logit]
    return logprobs, entropy


def head_logprobs(
    hidden: Tensor,  # [B, R, H] final (normed) hidden states that predict token_ids
    head: nn.Linear,
    token_ids: Tensor,  # [B, R]
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 256,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of ``token_ids`` from hidden states and the LM head, chunked.

    Args:
        hidden: hidden state at the position before each scored token.
        head: the output projection (``model.get_output_embeddings()``).
        token_ids: the tokens to score.
        temperature: divides the logits.
        with_entropy: also return the entropy of each position's distribution.
        chunk_tokens: positions per LM-head call; one chunk's ``[chunk_tokens, V]`` fp32 logits
            and softmax are the largest tensors here (256 × 49k: 50 MB each).
        entropy_grad: let gradients flow through the entropy (an entropy bonus); False when it
            is only logged, so no graph is kept for it.

    Returns:
        ``logprobs`` [B, R] fp32 and ``entropy`` [B, R] fp32 (None unless ``with_entropy``).
    """
    batch, length, width = hidden.shape
    flat_hidden, flat_ids = hidden.reshape(-1, width), token_ids.reshape(-1)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, flat_ids.numel(), chunk_tokens):
        args = (
            flat_hidden[start : start + chunk_tokens],
            head.weight,
            head.bias,
            flat_ids[start : start + chunk_tokens],
            temperature,
            with_entropy,
            entropy_grad,
        )
        lp, ent = checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args)
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    logprobs = torch.cat(logprob_chunks).view(batch, length)
    entropy = torch.cat(entropy_chunks).view(batch, length) if with_entropy else None
    return logprobs, entropy


LOGIT_POSTPROCESSING = (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0))
"""Config options (and their neutral values) of models whose logits are not ``lm_head(hidden)``."""


def split_head(model: Any) -> tuple[nn.Module, nn.Linear] | None:
    """The decoder stack and a plain ``nn.Linear`` LM head of ``model``, or None when unavailable.

    None (callers then take logits from the model's own forward) when the model has no
    ``get_decoder``, the head is not a plain linear layer (e.g. adapted by LoRA), the model
    post-processes its logits (:data:`LOGIT_POSTPROCESSING`: Gemma-2/3 soft-capping, Cohere's
    ``logit_scale``, Granite's ``logits_scaling``), or the weights are sharded DTensors, whose
    root-level parameters only the full module's forward gathers.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "get_decoder") or not hasattr(base, "get_output_embeddings"):
        return None
    config = getattr(base, "config", None)
    configs = [config, getattr(config, "text_config", None)] if config is not None else []
    if any(getattr(c, name, neutral) not in (None, neutral) for c in configs for name, neutral in LOGIT_POSTPROCESSING):
        return None  # the model's forward applies it; sampling saw it too
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(head.weight, DTensor):
        return None
    return base.get_decoder(), head
