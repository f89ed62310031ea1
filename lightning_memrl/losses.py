"""The policy loss: loss aggregation weights, PPO's clipped surrogate, KL estimators, entropy.

Every function here is pure (tensors in, tensors out) so it can be tested on hand-computed
numbers. Shapes use these names:

* ``M``: turns (conversations) in the batch; every trajectory has one or more turns.
* ``T``: padded response length of a turn.
* ``B``, ``R``: the rows and the response width of one micro-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_memrl.settings import GRPOSettings, KLEstimator, LossAggregation

LOG_RATIO_CLAMP = 20.0  # as verl: keeps exp() finite when the policy moved far from the old one
LOW_VAR_KL_CLAMP = 10.0  # verl's bound on the k3 estimate ("low_var_kl")


def loss_token_weights(
    mask: Tensor,  # [M, T] 1 on generated tokens that are trained on
    turn_to_trajectory: Tensor,  # [M] index of the trajectory each turn belongs to
    mode: LossAggregation,
    max_response_tokens: int,
) -> Tensor:  # [M, T]
    """Per-token weights such that the batch loss is ``(token_loss * weights).sum()``.

    Expressing every aggregation as weights over the *whole* batch lets micro-batches be summed
    into exactly the full-batch loss, whatever the micro-batch split.

    Args:
        mask: which response tokens count.
        turn_to_trajectory: trajectory id of each turn (any integers; ids are compared only).
        mode: ``token_mean`` (DAPO: every token in the batch weighs the same),
            ``seq_mean_token_mean`` (GRPO: every turn weighs the same, then tokens within it),
            ``seq_mean_token_sum_norm`` (Dr. GRPO: token sum over ``turns * max_response_tokens``,
            a constant normaliser), ``rollout_mean`` (every trajectory weighs the same however
            many turns and tokens it has).
        max_response_tokens: the constant of ``seq_mean_token_sum_norm``.
    """
    m = mask.float()
    num_turns = m.shape[0]
    if mode == "token_mean":
        return m / m.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_turn = m.sum(-1, keepdim=True).clamp(min=1)
        return m / per_turn / max(num_turns, 1)
    if mode == "seq_mean_token_sum_norm":
        return m / (max(num_turns, 1) * max_response_tokens)
    if mode == "rollout_mean":
        _, traj = torch.unique(turn_to_trajectory, return_inverse=True)  # [M] in 0..N-1
        num_traj = int(traj.max().item()) + 1 if num_turns else 1
        tokens_per_traj = torch.zeros(num_traj, dtype=m.dtype).index_add_(0, traj, m.sum(-1))
        return m / tokens_per_traj.clamp(min=1)[traj].unsqueeze(-1) / num_traj
    raise ValueError(
        "loss_aggregation must be one of token_mean, seq_mean_token_mean, "
        f"seq_mean_token_sum_norm, rollout_mean; got {mode!r}"
    )


def clipped_surrogate(
    logprobs: Tensor,  # [M, T] current policy
    old_logprobs: Tensor,  # [M, T] policy that generated the tokens
    advantages: Tensor,  # [M, T]
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate with clip-higher and optional dual clip.

    Returns:
        ``(token_loss, clipped, dual_clipped)``: the per-token loss ``-min(ρA, clip(ρ)A)``
        (bounded by ``-c·A`` for negative advantages when ``dual_clip=c``), and boolean masks of
        tokens where the ratio clip or the dual clip was active.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}")
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (token_loss > bound)
        token_loss = torch.where(dual_clipped, bound, token_loss)
    return token_loss, clipped, dual_clipped


def kl_penalty(
    logprobs: Tensor,  # [M, T]
    ref_logprobs: Tensor,  # [M, T]
    estimator: KLEstimator = "low_var_kl",
) -> Tensor:  # [M, T]
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    ``k1`` = ``logp - ref``; ``k3`` = ``exp(ref - logp) - (ref - logp) - 1`` (unbiased,
    non-negative); ``low_var_kl`` = k3 with the log-ratio clamped to ±20 and the result to ±10
    (verl).
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    if estimator == "k3":
        return log_ratio.exp() - log_ratio - 1.0
    if estimator == "low_var_kl":
        log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (log_ratio.exp() - log_ratio - 1.0).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"kl_estimator must be 'k1', 'k3' or 'low_var_kl', got {estimator!r}")


def entropy_from_logits(logits: Tensor) -> Tensor:  # [..., V] -> [...]
    """Entropy of the categorical distribution given by ``logits``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is set (0 when none is)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


def policy_loss(
    g: GRPOSettings,
    logprobs: Tensor,  # [B, R]
    old_logprobs: Tensor,  # [B, R]
    ref_logprobs: Tensor | None,  # [B, R]
    advantages: Tensor,  # [B, R]
    weights: Tensor,  # [B, R] aggregation weights over the whole batch
    entropy: Tensor | None,  # [B, R]
    mask: Tensor,  # [B, R]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate + β·KL − entropy bonus, aggregated by ``weights``.

    Returns the micro-batch's share of the batch loss and sums for metrics.
    """
    token_loss, clipped, dual_clipped = clipped_surrogate(
        logprobs, old_logprobs, advantages, g.clip_low, g.clip_high, g.dual_clip
    )
    stats = {"clip_frac": (clipped & mask).sum(), "dual_clip_frac": (dual_clipped & mask).sum()}
    if ref_logprobs is not None and g.kl_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs, g.kl_estimator)
        token_loss = token_loss + g.kl_coef * kl
        stats["kl"] = (kl.detach() * mask).sum()
    if entropy is not None:
        if g.entropy_coef:
            token_loss = token_loss - g.entropy_coef * entropy
        stats["entropy"] = (entropy.detach() * mask).sum()
    loss = (token_loss * weights).sum()
    return loss, stats
