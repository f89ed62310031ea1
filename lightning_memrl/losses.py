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

from lightning_memrl.settings import GRPOSettings, ImportanceSamplingLevel, KLEstimator, LossAggregation

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


def loss_mask(
    response_mask: Tensor,  # [M, T] 1 on generated tokens
    truncated: Tensor,  # [M] bool: the turn hit its token cap without ending
    mask_truncated_completions: bool,
) -> Tensor:  # [M, T] 1 on the tokens the loss trains
    """The tokens that carry loss: every generated token, less truncated turns' when ``mask_truncated_completions``."""
    if not mask_truncated_completions:
        return response_mask
    return response_mask * (~truncated.bool()).unsqueeze(-1).to(response_mask.dtype)


def importance_log_ratio(
    logprobs: Tensor,  # [M, T] current policy
    old_logprobs: Tensor,  # [M, T] policy that generated the tokens
    level: ImportanceSamplingLevel = "token",
    mask: Tensor | None = None,  # [M, T] response tokens; needed for "sequence"
) -> Tensor:  # [M, T]
    """``log ρ_t = logp_t - old_t`` per token, or (``sequence``, GSPO) its mean over each row's response tokens.

    GSPO's sequence ratio is ``s_i = exp(mean_t log ρ_{i,t})`` (length-normalised), the same for every token
    of row ``i``; its gradient is ``s_i · mean_t ∇log p_{i,t}``.
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level != "sequence":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    if mask is None:
        raise ValueError("importance_sampling_level 'sequence' needs the response mask")
    m = mask.to(log_ratio.dtype)
    per_row = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [M, 1]
    return per_row.expand_as(log_ratio)


def clipped_surrogate(
    logprobs: Tensor,  # [M, T] current policy
    old_logprobs: Tensor,  # [M, T] policy that generated the tokens
    advantages: Tensor,  # [M, T]
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    mask: Tensor | None = None,  # [M, T] response tokens; needed for "sequence"
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate with clip-higher and optional dual clip, over token or (GSPO) sequence ratios.

    Returns:
        ``(token_loss, clipped, dual_clipped)``: the per-token loss ``-min(ρA, clip(ρ)A)``
        (bounded by ``-c·A`` for negative advantages when ``dual_clip=c``), and boolean masks of
        tokens where the ratio clip or the dual clip was active.
    """
    log_ratio = importance_log_ratio(logprobs, old_logprobs, importance_sampling_level, mask)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
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


def cispo_surrogate(
    logprobs: Tensor,  # [M, T] current policy
    old_logprobs: Tensor,  # [M, T] policy that generated the tokens
    advantages: Tensor,  # [M, T]
    clip_high: float = 0.28,
    importance_sampling_level: ImportanceSamplingLevel = "token",
    mask: Tensor | None = None,  # [M, T] response tokens; needed for "sequence"
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg(min(ρ, 1 + clip_high)) · A · log p`` per token.

    The importance weight is clipped and detached, so no token loses its gradient (PPO's clip zeroes
    the gradient of clipped tokens); there is no lower bound, as in the paper.

    Returns:
        ``(token_loss, clipped, weight)``: the per-token loss, where the upper bound was active, and the
        detached clipped weight.
    """
    log_ratio = importance_log_ratio(logprobs, old_logprobs, importance_sampling_level, mask)
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().detach()
    weight = ratio.clamp(max=1.0 + clip_high)
    return -weight * advantages * logprobs, ratio > 1.0 + clip_high, weight


def high_entropy_mask(
    entropy: Tensor,  # [B, R]
    mask: Tensor,  # [B, R] response tokens
    top_entropy_quantile: float,
) -> Tensor:  # [B, R] bool
    """Response tokens whose entropy is at least the ``1 - top_entropy_quantile`` quantile of ``mask``'s tokens.

    TRL's definition (linear interpolation between order statistics, ``>=``): with entropies
    ``[0.1, 0.3, 0.5, 0.9]`` and 0.5 the threshold is 0.4 and the two highest are kept. No token
    (an empty mask) keeps nothing.
    """
    m = mask.bool()
    values = entropy.detach()[m].float()
    if values.numel() == 0:
        return torch.zeros_like(m)
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    return (entropy.detach().float() >= threshold) & m


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
    """The surrogate (``loss_type``, ``importance_sampling_level``, ``top_entropy_quantile``) + β·KL − entropy
    bonus, aggregated by ``weights``.

    Returns the micro-batch's share of the batch loss and sums over ``mask``'s tokens for metrics
    (``loss_variant/...`` only for the options that are on).
    """
    token_loss, stats = _surrogate(g, logprobs, old_logprobs, advantages, mask)
    if g.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the token entropies from sequence_logprobs")
        keep = high_entropy_mask(entropy, mask, g.top_entropy_quantile)
        token_loss = token_loss * keep
        stats["loss_variant/entropy_kept_frac"] = keep.sum()
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


def rows_without_gradient(
    g: GRPOSettings,
    advantages: Tensor,  # [M, T]
    weights: Tensor,  # [M, T] aggregation weights over the whole batch (loss_token_weights)
) -> Tensor:  # [M] bool
    """Rows whose share of :func:`policy_loss` has an exactly zero gradient, so the update can skip them.

    A row qualifies when no token of it carries aggregation weight (``mask_truncated_completions``),
    or when every weighted token's advantage is exactly 0 and neither the KL penalty (``kl_coef``)
    nor the entropy bonus (``entropy_coef``) applies: both surrogates (``clip``, also with
    ``dual_clip``, and ``cispo``) at either ``importance_sampling_level`` are then ``-0·(...)`` per
    token, and GSPO's sequence ratio only mixes a row's own tokens. ``top_entropy_quantile < 1``
    skips nothing: its threshold is a quantile over the micro-batch's rows, so a row's entropies
    move the other rows' selection. None qualifies when ``skip_zero_advantage`` is off. A new
    term of :func:`policy_loss` must be accounted for here.
    """
    rows = weights.shape[0]
    if not g.skip_zero_advantage or g.top_entropy_quantile < 1.0:
        return torch.zeros(rows, dtype=torch.bool)
    unweighted = weights == 0
    finite = torch.isfinite(advantages).all(-1)  # a NaN advantage makes the loss NaN: the step's guard must see it
    if g.kl_coef > 0 or g.entropy_coef != 0:
        return unweighted.all(-1) & finite
    return (unweighted | (advantages == 0)).all(-1) & finite


def _surrogate(
    g: GRPOSettings,
    logprobs: Tensor,  # [B, R]
    old_logprobs: Tensor,  # [B, R]
    advantages: Tensor,  # [B, R]
    mask: Tensor,  # [B, R]
) -> tuple[Tensor, dict[str, Tensor]]:  # [B, R] token loss, metric sums
    """The policy-gradient term of ``g.loss_type`` at ``g.importance_sampling_level``."""
    level = g.importance_sampling_level
    if g.loss_type == "cispo":
        token_loss, clipped, weight = cispo_surrogate(logprobs, old_logprobs, advantages, g.clip_high, level, mask)
        stats = {"clip_frac": (clipped & mask).sum(), "loss_variant/cispo_weight": (weight * mask).sum()}
        return token_loss, stats
    token_loss, clipped, dual_clipped = clipped_surrogate(
        logprobs, old_logprobs, advantages, g.clip_low, g.clip_high, g.dual_clip, level, mask
    )
    stats = {"clip_frac": (clipped & mask).sum(), "dual_clip_frac": (dual_clipped & mask).sum()}
    if level == "sequence":
        ratio = importance_log_ratio(logprobs.detach(), old_logprobs, level, mask).clamp(max=LOG_RATIO_CLAMP).exp()
        stats["loss_variant/sequence_ratio"] = (ratio * mask).sum()
    return token_loss, stats
