"""GRPO math: advantages, loss weights, clipped surrogate, KL estimators and entropy.

Every function here is pure (tensors in, tensors out) so it can be tested on hand-computed
numbers. Shapes use these names:

* ``N``: trajectories in the batch (``num_tasks * group_size``), grouped contiguously.
* ``M``: turns (conversations) in the batch; every trajectory has one or more turns.
* ``T``: padded response length of a turn.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "rollout_mean"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]

LOG_RATIO_CLAMP = 20.0  # as verl: keeps exp() finite when the policy moved far from the old one
LOW_VAR_KL_CLAMP = 10.0  # verl's bound on the k3 estimate ("low_var_kl")


def group_advantages(
    rewards: Tensor,  # [N], NaN (or ±inf) marks a reward that could not be computed
    group_size: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> Tensor:  # [N]
    """GRPO advantages: reward minus its group's mean, optionally divided by a std.

    Args:
        rewards: one reward per trajectory; the ``group_size`` members of a group are contiguous.
            NaN and ±inf rewards are left out of their group's mean and std and get advantage 0.
            Statistics are computed in float64, so rewards as large as 1e30 keep their advantages.
        group_size: members per group.
        scale_rewards: ``group`` divides by the group's std (GRPO), ``batch`` by the std of all
            valid rewards in the batch (the mean stays per group), ``none`` does not divide
            (Dr. GRPO).
        eps: added to the std so a zero-variance group gives 0, not NaN.

    Returns:
        One advantage per trajectory (float32). A group whose valid rewards are all equal gets 0.
    """
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries")
    r = rewards.double().view(-1, group_size)  # [N/G, G]; float32 squares overflow above ~1e19
    valid = torch.isfinite(r)
    count = valid.sum(-1, keepdim=True)  # [N/G, 1]
    filled = torch.where(valid, r, torch.zeros_like(r))
    mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(valid, r - mean, torch.zeros_like(r))
    if scale_rewards == "group":
        # unbiased std, as torch.std (TRL); a group with a single valid reward has no spread
        var = (centered**2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
        centered = centered / (var.sqrt() + eps)
    elif scale_rewards == "batch":
        flat = r[valid]
        std = flat.std() if flat.numel() > 1 else torch.zeros((), dtype=r.dtype)
        centered = centered / (std + eps)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    centered = torch.where(count > 1, centered, torch.zeros_like(centered))
    return centered.view(-1).float()


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
