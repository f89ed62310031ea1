"""The loss options users know from TRL/verl (GSPO, CISPO, top_entropy_quantile, mask_truncated_completions)
against numbers worked out by hand in the comments; their defaults leave the loss exactly as it was."""

from __future__ import annotations

import math

import pytest
import torch
from test_module import _data, _module

from lightning_memrl import GRPOSettings
from lightning_memrl.advantages import assign_advantages
from lightning_memrl.errors import ConfigError
from lightning_memrl.losses import (
    cispo_surrogate,
    clipped_surrogate,
    high_entropy_mask,
    importance_log_ratio,
    loss_mask,
    loss_token_weights,
    policy_loss,
)


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# Two turns (rows), R = 2. Row 0: two tokens, log-ratios 0.1 and 0.3; row 1: one token, log-ratio -0.2, then a
# pad whose log-ratio 5.0 must not count.
LOG_RATIO = torch.tensor([[0.1, 0.3], [-0.2, 5.0]])
MASK = torch.tensor([[True, True], [True, False]])
ADV = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])


# --------------------------------------------------------------------------- GSPO: importance_sampling_level
def test_sequence_log_ratio_is_the_mean_over_each_rows_response_tokens() -> None:
    # row 0: (0.1 + 0.3) / 2 = 0.2 on both tokens; row 1: -0.2 / 1 = -0.2 (the pad's 5.0 left out), broadcast
    seq = importance_log_ratio(LOG_RATIO, torch.zeros(2, 2), "sequence", MASK)
    close(seq, [[0.2, 0.2], [-0.2, -0.2]])
    assert torch.equal(importance_log_ratio(LOG_RATIO, torch.zeros(2, 2), "token"), LOG_RATIO)


def test_gspo_clips_the_sequence_ratio_not_the_token_ratios() -> None:
    # s_0 = e^0.2 = 1.2214028, s_1 = e^-0.2 = 0.8187308
    # clip 0.25 -> [0.75, 1.25]: both inside, loss -A*s: row 0 -1.2214028 on both tokens, row 1 +0.8187308
    loss, clipped, _ = clipped_surrogate(LOG_RATIO, torch.zeros(2, 2), ADV, 0.25, 0.25, None, "sequence", MASK)
    close(loss[MASK], [-1.2214028, -1.2214028, 0.8187308])
    assert not clipped[MASK].any()
    # token level: e^0.1 = 1.1051709 inside -> -1.1051709; e^0.3 = 1.3498588 clipped -> -1.25; e^-0.2 as above
    loss, clipped, _ = clipped_surrogate(LOG_RATIO, torch.zeros(2, 2), ADV, 0.25, 0.25)
    close(loss[MASK], [-1.1051709, -1.25, 0.8187308])
    assert clipped[MASK].tolist() == [False, True, False]
    # GSPO's narrow range, clip_low 3e-4 / clip_high 4e-4: s_0 clipped to 1.0004 -> -1.0004, s_1 to 0.9997 -> 0.9997
    loss, clipped, _ = clipped_surrogate(LOG_RATIO, torch.zeros(2, 2), ADV, 3e-4, 4e-4, None, "sequence", MASK)
    close(loss[MASK], [-1.0004, -1.0004, 0.9997])
    assert clipped[MASK].all()


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient() -> None:
    # L = sum over row 0's tokens of -A*s_0 = -2 s_0, s_0 = exp((lp_0 + lp_1) / 2):
    # dL/dlp_t = -2 * s_0 * 1/2 = -s_0 = -1.2214028 for both tokens
    logprobs = LOG_RATIO.clone().requires_grad_(True)
    loss, _, _ = clipped_surrogate(logprobs, torch.zeros(2, 2), ADV, 0.25, 0.25, None, "sequence", MASK)
    loss[0].sum().backward()
    close(logprobs.grad[0], [-1.2214028, -1.2214028])
    close(logprobs.grad[1], [0.0, 0.0])


# --------------------------------------------------------------------------- CISPO: loss_type
def test_cispo_clips_the_detached_weight_and_keeps_every_tokens_gradient() -> None:
    # logp = [ln .5, ln .2, ln .1], old = [ln .25, ln .2, ln 1]: rho = [2, 1, 0.1]; clip_high 0.5 -> bound 1.5
    # weight = [1.5, 1.0, 0.1] (no lower bound); A = [1, -2, 1]
    # loss = -w*A*logp = [-1.5 * ln .5, 2 * ln .2, -0.1 * ln .1] = [1.0397208, -3.2188758, 0.2302585]
    logprobs = torch.tensor([[0.5, 0.2, 0.1]]).log().requires_grad_(True)
    old = torch.tensor([[0.25, 0.2, 1.0]]).log()
    adv = torch.tensor([[1.0, -2.0, 1.0]])
    loss, clipped, weight = cispo_surrogate(logprobs, old, adv, clip_high=0.5)
    close(loss, [[1.0397208, -3.2188758, 0.2302585]])
    close(weight, [[1.5, 1.0, 0.1]])
    assert clipped.tolist() == [[True, False, False]]
    # the gradient flows through log p only: dL/dlogp = -w*A = [-1.5, 2.0, -0.1]; PPO's clip would give the
    # first token (rho 2 > 1.5, A > 0) no gradient at all
    loss.sum().backward()
    close(logprobs.grad, [[-1.5, 2.0, -0.1]])


def test_policy_loss_with_cispo_logs_the_mean_weight() -> None:
    # one epoch: old = logp, so rho = 1, weight 1 on all three tokens: cispo_weight sum 3, no clip
    g = GRPOSettings(loss_type="cispo", clip_high=4.0)
    logp = torch.tensor([[0.5, 0.2, 0.1]]).log()
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights = torch.full((1, 3), 1 / 3)
    loss, stats = policy_loss(g, logp, logp, None, torch.ones(1, 3), weights, None, mask)
    # -(ln .5 + ln .2 + ln .1) / 3 = (0.6931472 + 1.6094379 + 2.3025851) / 3 = 1.5350567
    close(loss, 1.5350567)
    assert float(stats["loss_variant/cispo_weight"]) == pytest.approx(3.0)
    assert float(stats["clip_frac"]) == 0.0


# --------------------------------------------------------------------------- top_entropy_quantile
ENTROPY = torch.tensor([[0.1, 0.5, 7.0], [0.9, 0.3, 0.0]])  # the third column is padding
ENT_MASK = torch.tensor([[True, True, False], [True, True, False]])


@pytest.mark.parametrize(
    "quantile, kept",
    [
        # response entropies sorted [0.1, 0.3, 0.5, 0.9] (positions 0..3)
        # q 0.5: the 0.5 quantile sits at 1.5 -> 0.3 + 0.5 * (0.5 - 0.3) = 0.4: keeps 0.5 and 0.9
        (0.5, [[False, True, False], [True, False, False]]),
        # q 0.25: the 0.75 quantile at 2.25 -> 0.5 + 0.25 * 0.4 = 0.6: keeps 0.9 only
        (0.25, [[False, False, False], [True, False, False]]),
        # q 1: the 0 quantile is the minimum 0.1: keeps every response token (never the pad's 7.0)
        (1.0, [[True, True, False], [True, True, False]]),
    ],
)
def test_high_entropy_mask_keeps_the_top_quantile(quantile: float, kept: list) -> None:
    assert high_entropy_mask(ENTROPY, ENT_MASK, quantile).tolist() == kept


def test_top_entropy_quantile_masks_the_surrogate_but_keeps_kl_and_the_denominator() -> None:
    # ratio 1 (old = logp), clip loss -A: [[-1, -2], [-3, -4]]; q 0.5 keeps entropies 0.5 and 0.9:
    #   surrogate [[0, -2], [-3, 0]]
    # k1 KL with ref = logp - 0.5 is 0.5 per token, times kl_coef 0.1 = 0.05 on all four tokens
    # token_mean weights 1/4: (0.05 - 1.95 - 2.95 + 0.05) / 4 = -4.8 / 4 = -1.2
    g = GRPOSettings(top_entropy_quantile=0.5, kl_coef=0.1, kl_estimator="k1")
    logp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 0.0]])
    weights = loss_token_weights(ENT_MASK, torch.tensor([0, 1]), "token_mean", 3)
    loss, stats = policy_loss(g, logp, logp, logp - 0.5, adv, weights, ENTROPY, ENT_MASK)
    close(loss, -1.2)
    assert float(stats["loss_variant/entropy_kept_frac"]) == 2.0  # kept tokens, a share of 4 after the update


def test_top_entropy_quantile_needs_entropies() -> None:
    g = GRPOSettings(top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        policy_loss(g, torch.zeros(1, 2), torch.zeros(1, 2), None, torch.ones(1, 2), torch.ones(1, 2), None, MASK[:1])


# --------------------------------------------------------------------------- mask_truncated_completions
def test_truncated_turns_leave_the_loss_and_its_token_count() -> None:
    # turns of 3, 1, 4, 2 tokens; turn 1 truncated -> 9 tokens left, token_mean 1/9 each, turn 1 weight 0
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    truncated = torch.tensor([False, True, False, False])
    assert torch.equal(loss_mask(mask, truncated, False), mask)
    trained = loss_mask(mask, truncated, True)
    assert trained.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    weights = loss_token_weights(trained, torch.tensor([0, 0, 1, 2]), "token_mean", 4)
    close(weights, trained.float() / 9.0)


# --------------------------------------------------------------------------- defaults and options
def test_defaults_give_exactly_the_clipped_surrogate() -> None:
    g = GRPOSettings()
    assert (g.loss_type, g.importance_sampling_level, g.top_entropy_quantile, g.mask_truncated_completions) == (
        "clip",
        "token",
        1.0,
        False,
    )
    old = torch.zeros(2, 2)
    weights = torch.full((2, 2), 0.25)
    loss, stats = policy_loss(g, LOG_RATIO, old, None, ADV, weights, torch.ones(2, 2), MASK)
    token_loss, _, _ = clipped_surrogate(LOG_RATIO, old, ADV, g.clip_low, g.clip_high)
    assert torch.equal(loss, ((token_loss) * weights).sum())
    assert set(stats) == {"clip_frac", "dual_clip_frac", "entropy"}  # no loss_variant metric unless asked


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "ppo"}, "model.init_args.grpo.loss_type must be one of clip, cispo"),
        ({"importance_sampling_level": "seq"}, "importance_sampling_level must be one of token, sequence"),
        ({"top_entropy_quantile": 0.0}, r"top_entropy_quantile must be in \(0.0, 1.0\]"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in"),
        ({"loss_type": "cispo", "dual_clip": 3.0}, "grpo.dual_clip bounds the clipped surrogate"),
    ],
)
def test_bad_loss_options_name_the_option(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GRPOSettings(**kwargs)


# --------------------------------------------------------------------------- through the update
def _update(truncate: bool, **grpo):
    torch.manual_seed(0)
    module = _module(micro_batch_tokens=100_000, max_grad_norm=0.0, **grpo)
    module.configure_model()
    tasks = _data()
    tasks.setup()
    rollouts = module.rollout([t for t in tasks.train_tasks[:2] for _ in range(2)], module.generation)
    rollouts.truncated[:] = truncate
    rollouts.rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    assign_advantages(rollouts, module.advantage)
    grads = []

    class _Opt:
        param_groups = [{"lr": 0.0}]

        def step(self):
            grads.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in module.policy.parameters())

        def zero_grad(self, set_to_none=True):
            module.policy.zero_grad(set_to_none=True)

    opt = _Opt()
    module.optimizers, module.lr_schedulers = (lambda: opt), (lambda: None)
    module.manual_backward = lambda loss: loss.backward()
    return grads, module.update(rollouts)


def test_update_with_every_turn_truncated_trains_nothing() -> None:
    grads, stats = _update(True, mask_truncated_completions=True)
    assert stats["loss_variant/truncated_masked_frac"] == 1.0
    assert stats["loss"] == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)
    plain, plain_stats = _update(True)  # the same batch without the option trains
    assert "loss_variant/truncated_masked_frac" not in plain_stats
    assert any(float(g.abs().max()) > 0.0 for g in plain)


def test_update_logs_each_variant_metric() -> None:
    _, stats = _update(False, importance_sampling_level="sequence", top_entropy_quantile=0.5)
    # one epoch: old = current log-probs, every sequence ratio is exactly 1
    assert stats["loss_variant/sequence_ratio"] == pytest.approx(1.0)
    assert 0.4 <= stats["loss_variant/entropy_kept_frac"] <= 0.6 + 1e-6  # about half the tokens (ties aside)
    _, stats = _update(False, loss_type="cispo")
    assert stats["loss_variant/cispo_weight"] == pytest.approx(1.0)
    assert not math.isnan(stats["loss"])
