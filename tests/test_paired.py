"""lightning_memrl.evaluation.paired: paired differences, the task bootstrap and the sign test."""

from __future__ import annotations

import pytest

from lightning_memrl.evaluation.paired import paired_comparison, sign_test_p


def test_sign_test_against_hand_computed_tails():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)  # 2 * C(5,0) / 2^5
    assert sign_test_p(1, 7) == pytest.approx(2 * (1 + 8) / 256)  # 2 * (C(8,0) + C(8,1)) / 2^8
    assert sign_test_p(2, 1) == 1.0  # 2 * (1 + 3) / 8 = 1, capped


def test_mean_difference_counts_and_p_on_shared_keys_only():
    reference = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "only_ref": 1.0}
    candidate = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "only_cand": 0.0}
    result = paired_comparison(reference, candidate)
    assert result.pairs == 4
    assert result.mean_difference == pytest.approx(0.25)  # (0 + 1 + 1 - 1) / 4
    assert (result.wins, result.losses) == (2, 1)
    assert result.sign_test_p == 1.0
    assert -1.0 <= result.ci_low <= 0.25 <= result.ci_high <= 1.0


def test_constant_differences_give_a_degenerate_interval():
    result = paired_comparison({i: 0.0 for i in range(10)}, {i: 1.0 for i in range(10)})
    assert (result.mean_difference, result.ci_low, result.ci_high) == (1.0, 1.0, 1.0)
    assert result.sign_test_p == pytest.approx(2 / 1024)


def test_bootstrap_resamples_whole_clusters():
    # Five tasks gain 1 at both seeds, five lose 1 at both: resampling tasks keeps each task's two pairs
    # together, so the interval is that of 10 independent values (std 1/sqrt(10)), wider than the one
    # that wrongly treats the 20 pairs as independent (std 1/sqrt(20)).
    tasks = [f"t{i}" for i in range(10)]
    reference = {(s, t): 0.0 for s in (0, 1) for t in tasks}
    candidate = {(s, t): (1.0 if i < 5 else -1.0) for s in (0, 1) for i, t in enumerate(tasks)}
    clustered = paired_comparison(reference, candidate, cluster_of={k: k[1] for k in reference})
    unclustered = paired_comparison(reference, candidate)
    assert clustered.mean_difference == unclustered.mean_difference == 0.0
    assert abs(clustered.ci_low * 10 - round(clustered.ci_low * 10)) < 1e-9  # a mean of 10 whole-task values
    assert clustered.ci_high - clustered.ci_low > unclustered.ci_high - unclustered.ci_low
    assert clustered.ci_high == pytest.approx(0.6, abs=0.2)  # ~1.96 / sqrt(10)


def test_same_inputs_give_the_same_interval_and_no_overlap_raises():
    reference = {i: float(i % 2) for i in range(30)}
    candidate = {i: float(i % 3 == 0) for i in range(30)}
    assert paired_comparison(reference, candidate, seed=3) == paired_comparison(reference, candidate, seed=3)
    with pytest.raises(ValueError, match="share no scored task"):
        paired_comparison({"a": 1.0}, {"b": 1.0})
