"""Unit tests of lightning_memrl.losses against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_memrl.losses import (
    clipped_surrogate,
    entropy_from_logits,
    kl_penalty,
    loss_token_weights,
    masked_mean,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------- loss_token_weights
# Four turns, T = 4:
#   row 0: 3 tokens, trajectory 5
#   row 1: 1 token,  trajectory 5   (trajectory 5 has two turns, 4 tokens)
#   row 2: 4 tokens, trajectory 9   (one turn, 4 tokens)
#   row 3: 2 tokens, trajectory 2   (one turn, 2 tokens)
# 10 tokens, M = 4 turns, 3 trajectories; ids are arbitrary, not sorted
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
TURN_TO_TRAJ = torch.tensor([5, 5, 9, 2])


def test_token_mean_weights() -> None:
    # every token 1/10
    w = loss_token_weights(MASK, TURN_TO_TRAJ, "token_mean", max_response_tokens=8)
    expected = MASK.float() / 10.0
    close(w, expected)
    close(w.sum(), 1.0)


def test_seq_mean_token_mean_weights() -> None:
    # each turn weighs 1/4, split over its tokens: 1/12, 1/4, 1/16, 1/8
    w = loss_token_weights(MASK, TURN_TO_TRAJ, "seq_mean_token_mean", max_response_tokens=8)
    a, b, c, d = 1 / 12, 1 / 4, 1 / 16, 1 / 8
    expected = [[a, a, a, 0], [b, 0, 0, 0], [c, c, c, c], [d, d, 0, 0]]
    close(w, expected)
    close(w.sum(-1), [0.25, 0.25, 0.25, 0.25])
    close(w.sum(), 1.0)


def test_seq_mean_token_sum_norm_weights() -> None:
    # constant 1 / (M * max_response_tokens) = 1 / (4 * 8) = 1/32 on each token; total 10/32 = 5/16
    w = loss_token_weights(MASK, TURN_TO_TRAJ, "seq_mean_token_sum_norm", max_response_tokens=8)
    close(w, MASK.float() / 32.0)
    close(w.sum(), 5.0 / 16.0)


def test_rollout_mean_weights() -> None:
    # each trajectory weighs 1/3, split over its tokens:
    #   trajectory 5: 4 tokens over two turns -> 1/12 each
    #   trajectory 9: 4 tokens -> 1/12; trajectory 2: 2 tokens -> 1/6
    w = loss_token_weights(MASK, TURN_TO_TRAJ, "rollout_mean", max_response_tokens=8)
    a, b = 1 / 12, 1 / 6
    expected = [[a, a, a, 0], [a, 0, 0, 0], [a, a, a, a], [b, b, 0, 0]]
    close(w, expected)
    close(w[:2].sum(), 1 / 3)  # trajectory 5, both turns together
    close(w[2].sum(), 1 / 3)
    close(w[3].sum(), 1 / 3)
    close(w.sum(), 1.0)


def test_rollout_mean_ignores_id_values() -> None:
    w1 = loss_token_weights(MASK, TURN_TO_TRAJ, "rollout_mean", max_response_tokens=8)
    w2 = loss_token_weights(MASK, torch.tensor([0, 0, 1, 2]), "rollout_mean", max_response_tokens=8)
    assert torch.equal(w1, w2)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "rollout_mean"])
def test_weights_zero_on_padding(mode: str) -> None:
    w = loss_token_weights(MASK, TURN_TO_TRAJ, mode, max_response_tokens=8)
    assert torch.all(w[MASK == 0] == 0)
    assert torch.all(w[MASK == 1] > 0)


@pytest.mark.parametrize(
    "mode, expected_total",
    [
        # token loss = 1..16 laid row-major over MASK; masked tokens are
        #   row 0: 1, 2, 3   row 1: 5   row 2: 9, 10, 11, 12   row 3: 13, 14
        # token_mean: (1+2+3+5+9+10+11+12+13+14)/10 = 80/10 = 8
        ("token_mean", 8.0),
        # seq_mean_token_mean: mean per row 2, 5, 10.5, 13.5 -> (2+5+10.5+13.5)/4 = 31/4 = 7.75
        ("seq_mean_token_mean", 7.75),
        # seq_mean_token_sum_norm: 80/32 = 2.5
        ("seq_mean_token_sum_norm", 2.5),
        # rollout_mean: traj 5 (1+2+3+5)/4 = 2.75, traj 9 42/4 = 10.5, traj 2 27/2 = 13.5 -> 26.75/3
        ("rollout_mean", 26.75 / 3),
    ],
)
def test_micro_batches_sum_to_full_batch(mode: str, expected_total: float) -> None:
    token_loss = torch.arange(1, 17, dtype=torch.float32).view(4, 4)
    w = loss_token_weights(MASK, TURN_TO_TRAJ, mode, max_response_tokens=8)
    full = (token_loss * w).sum()
    close(full, expected_total, atol=1e-5)
    # split rows into two micro-batches, one cutting trajectory 5 in half, and trim padding of one
    first, second = [0, 2], [1, 3]
    part1 = (token_loss[first] * w[first]).sum()
    part2 = (token_loss[second][:, :2] * w[second][:, :2]).sum()
    close(part1 + part2, full.item(), atol=1e-5)


def test_loss_token_weights_bad_mode() -> None:
    with pytest.raises(ValueError):
        loss_token_weights(MASK, TURN_TO_TRAJ, "sum", max_response_tokens=8)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- clipped_surrogate
def surrogate(ratios, advantages, **kwargs):
    ratio = torch.tensor([ratios], dtype=torch.float32)
    old = torch.zeros_like(ratio)
    adv = torch.tensor([advantages], dtype=torch.float32)
    return clipped_surrogate(ratio.log(), old, adv, **kwargs)


def test_ratio_inside_clip_range() -> None:
    # ratio 1.1, A = 2: -A*ratio = -2.2, clip(1.1) = 1.1 -> -2.2, not clipped
    # ratio 0.9, A = -1: 0.9, not clipped
    loss, clipped, dual = surrogate([1.1, 0.9], [2.0, -1.0])
    close(loss, [[-2.2, 0.9]])
    assert not clipped.any()
    assert not dual.any()


def test_ratio_above_clip_with_positive_advantage_is_clipped() -> None:
    # ratio 1.5, A = 1: unclipped -1.5, clipped -1.2 -> max = -1.2
    loss, clipped, _ = surrogate([1.5], [1.0])
    close(loss, [[-1.2]])
    assert clipped.tolist() == [[True]]


def test_ratio_below_clip_with_negative_advantage_is_clipped() -> None:
    # ratio 0.5, A = -1: unclipped 0.5, clipped 0.8 -> 0.8
    loss, clipped, _ = surrogate([0.5], [-1.0])
    close(loss, [[0.8]])
    assert clipped.tolist() == [[True]]


def test_pessimistic_side_is_not_clipped() -> None:
    # ratio 0.5, A = +1: unclipped -0.5, clipped -0.8 -> -0.5 (unclipped wins)
    # ratio 1.5, A = -1: unclipped 1.5, clipped 1.2 -> 1.5
    loss, clipped, _ = surrogate([0.5, 1.5], [1.0, -1.0])
    close(loss, [[-0.5, 1.5]])
    assert not clipped.any()


def test_asymmetric_clip() -> None:
    # clip_low 0.3, clip_high 0.28 -> range [0.7, 1.28]
    # ratio 1.25, A = 1: inside -> -1.25 (would be clipped to -1.2 with clip_high 0.2)
    # ratio 1.4,  A = 1: clipped -> -1.28
    # ratio 0.75, A = -1: inside -> 0.75 (would be 0.8 with clip_low 0.2)
    # ratio 0.6,  A = -1: clipped -> 0.7
    loss, clipped, _ = surrogate([1.25, 1.4, 0.75, 0.6], [1.0, 1.0, -1.0, -1.0], clip_low=0.3, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.75, 0.7]])
    assert clipped.tolist() == [[False, True, False, True]]
    # the same ratios with symmetric 0.2
    loss, clipped, _ = surrogate([1.25, 1.4, 0.75, 0.6], [1.0, 1.0, -1.0, -1.0])
    close(loss, [[-1.2, -1.2, 0.8, 0.8]])
    assert clipped.all()


def test_dual_clip_bounds_negative_advantage() -> None:
    # c = 3
    # ratio 5,  A = -1: max(5, 1.2) = 5 > -c*A = 3 -> 3, dual clipped
    # ratio 10, A = -2: max(20, 2.4) = 20 > 6 -> 6, dual clipped
    # ratio 2,  A = -1: max(2, 1.2) = 2 <= 3 -> 2, not dual clipped
    # ratio 5,  A = +1: max(-5, -1.2) = -1.2, positive advantage: never dual clipped
    loss, clipped, dual = surrogate([5.0, 10.0, 2.0, 5.0], [-1.0, -2.0, -1.0, 1.0], dual_clip=3.0)
    close(loss, [[3.0, 6.0, 2.0, -1.2]], atol=1e-5)
    assert dual.tolist() == [[True, True, False, False]]
    assert clipped.tolist() == [[False, False, False, True]]
    # without dual clip the loss is unbounded
    loss, _, dual = surrogate([5.0, 10.0], [-1.0, -2.0])
    close(loss, [[5.0, 20.0]], atol=1e-5)
    assert not dual.any()


def test_log_ratio_is_clamped_at_20() -> None:
    # log-ratio 50 -> clamped to 20 -> ratio e^20 = 485165195.4; A = -1 -> loss e^20, dual clip c=3 -> 3
    logp, old, adv = torch.tensor([[50.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]])
    loss, _, _ = clipped_surrogate(logp, old, adv)
    close(loss, [[485165195.4]], atol=1.0)
    loss, _, dual = clipped_surrogate(logp, old, adv, dual_clip=3.0)
    close(loss, [[3.0]])
    assert dual.item()


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c: float) -> None:
    with pytest.raises(ValueError):
        surrogate([1.0], [-1.0], dual_clip=c)


def test_zero_advantage_gives_zero_loss() -> None:
    loss, clipped, dual = surrogate([0.1, 1.0, 9.0], [0.0, 0.0, 0.0], dual_clip=3.0)
    assert torch.equal(loss.abs(), torch.zeros(1, 3))
    assert not clipped.any() and not dual.any()


# --------------------------------------------------------------------------- kl_penalty
LOGP_HALF = torch.tensor([[math.log(0.5)]])
LOGP_QUARTER = torch.tensor([[math.log(0.25)]])


def test_k1() -> None:
    # log 0.5 - log 0.25 = log 2 = 0.6931472; the other way -0.6931472
    close(kl_penalty(LOGP_HALF, LOGP_QUARTER, "k1"), [[0.6931472]])
    close(kl_penalty(LOGP_QUARTER, LOGP_HALF, "k1"), [[-0.6931472]])


def test_k3() -> None:
    # logp = log 0.5, ref = log 0.25: r = ref - logp = log 0.5 = -0.6931472
    #   exp(r) - r - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    close(kl_penalty(LOGP_HALF, LOGP_QUARTER, "k3"), [[0.1931472]])
    # logp = log 0.25, ref = log 0.5: r = log 2: 2 - 0.6931472 - 1 = 0.3068528
    close(kl_penalty(LOGP_QUARTER, LOGP_HALF, "k3"), [[0.3068528]])
    # equal -> 0
    close(kl_penalty(LOGP_HALF, LOGP_HALF, "k3"), [[0.0]])


def test_low_var_kl_matches_k3_on_small_ratio() -> None:
    close(kl_penalty(LOGP_HALF, LOGP_QUARTER, "low_var_kl"), [[0.1931472]])
    close(kl_penalty(LOGP_QUARTER, LOGP_HALF, "low_var_kl"), [[0.3068528]])


def test_low_var_kl_is_default() -> None:
    assert torch.equal(kl_penalty(LOGP_HALF, LOGP_QUARTER), kl_penalty(LOGP_HALF, LOGP_QUARTER, "low_var_kl"))


def test_low_var_kl_clamps_at_10() -> None:
    logp = torch.tensor([[0.0, 0.0, 0.0]])
    ref = torch.tensor([[5.0, -30.0, 2.0]])
    # r = 5:   k3 = e^5 - 5 - 1 = 148.4131591 - 6 = 142.4131591 -> low_var 10
    # r = -30: k3 = e^-30 + 30 - 1 = 29.0 -> low_var: r clamped to -20 -> 19 -> 10
    # r = 2:   k3 = e^2 - 3 = 7.3890561 - 3 = 4.3890561 (below the clamp, unchanged)
    close(kl_penalty(logp, ref, "k3"), [[142.4131591, 29.0, 4.3890561]], atol=1e-4)
    close(kl_penalty(logp, ref, "low_var_kl"), [[10.0, 10.0, 4.3890561]], atol=1e-5)


def test_kl_bad_estimator() -> None:
    with pytest.raises(ValueError):
        kl_penalty(LOGP_HALF, LOGP_QUARTER, "k2")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- entropy, masked_mean
def test_entropy_uniform_is_log_v() -> None:
    # uniform over 8: log 8 = 2.0794415; any constant shift of the logits gives the same
    close(entropy_from_logits(torch.zeros(8)), 2.0794415)
    close(entropy_from_logits(torch.full((2, 3, 8), 3.0)), torch.full((2, 3), 2.0794415))


def test_entropy_known_distribution() -> None:
    # p = [1/2, 1/4, 1/4]: H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1/2 ln 2 + ln 2 = 1.5 ln 2 = 1.0397208
    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    close(entropy_from_logits(logits), 1.0397208)


def test_entropy_one_hot_is_zero() -> None:
    # logits [100, 0, 0, 0]: p of the others e^-100 ~ 3.7e-44 -> entropy ~ 0
    h = entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0, 0.0]]))
    assert h.shape == (1,)
    assert 0.0 <= h.item() < 1e-6


def test_entropy_half_precision_input_is_computed_in_float32() -> None:
    h = entropy_from_logits(torch.zeros(4, dtype=torch.bfloat16))
    assert h.dtype == torch.float32
    close(h, math.log(4))


def test_masked_mean() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # mask picks 1 and 3 -> 2
    close(masked_mean(values, torch.tensor([[1, 0], [1, 0]])), 2.0)
    close(masked_mean(values, torch.tensor([[True, True], [False, True]])), 7.0 / 3.0)
    # nothing selected -> 0
    close(masked_mean(values, torch.zeros(2, 2, dtype=torch.bool)), 0.0)
