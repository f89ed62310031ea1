"""Paired comparison of two runs scored on the same held-out tasks.

Two arms evaluated on the same tasks differ task by task; comparing their means alone throws that
pairing away and needs far more tasks to separate them. :func:`paired_comparison` gives the mean
per-task difference, a bootstrap interval that resamples *tasks* (all seeds of a task together, so
seeds of one task are not counted as independent evidence), and the exact sign test on the
discordant pairs (McNemar's exact test when the scores are 0/1 exact match):

    d_i = candidate_i - reference_i
    mean = (1/n) sum_i d_i
    CI   = 2.5 and 97.5 percentiles of mean over B resamples of the task clusters (with replacement)
    p    = min(1, 2 * sum_{k=0}^{min(w, l)} C(w + l, k) / 2^(w + l)),  w = #{d_i > 0}, l = #{d_i < 0}
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PairedComparison:
    """The candidate minus the reference over the pairs both scored (units of the scores)."""

    pairs: int  # scored pairs (task x seed) both runs have
    mean_difference: float  # mean of candidate - reference
    ci_low: float  # bootstrap percentile interval of the mean difference
    ci_high: float
    wins: int  # pairs where the candidate scored higher
    losses: int  # pairs where the reference scored higher
    sign_test_p: float  # exact two-sided sign test on wins vs losses (McNemar for 0/1 scores)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test: the chance of a split at least this uneven when each side is 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(
    reference: Mapping[Any, float],
    candidate: Mapping[Any, float],
    cluster_of: Mapping[Any, Any] | None = None,
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> PairedComparison:
    """Compare ``candidate`` with ``reference`` on the keys both scored.

    Args:
        reference: score per key (e.g. ``(seed, task_id) -> exact match``).
        candidate: score per key, same units.
        cluster_of: the resampling unit of each key (e.g. ``task_id``); default: every key its own.
        confidence: the bootstrap interval's coverage.
        resamples: bootstrap resamples (fixed ``seed``: the same inputs give the same interval).
        seed: seed of the bootstrap.

    Returns:
        The :class:`PairedComparison`.

    Raises:
        ValueError: when the two runs share no key.
    """
    keys = [k for k in reference if k in candidate]
    if not keys:
        raise ValueError("the two runs share no scored task: nothing to compare")
    diff = {k: float(candidate[k]) - float(reference[k]) for k in keys}
    clusters: dict[Any, list[float]] = {}
    for k in keys:
        clusters.setdefault(cluster_of[k] if cluster_of is not None else k, []).append(diff[k])
    sums = [(sum(v), len(v)) for v in clusters.values()]
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        picks = rng.choices(sums, k=len(sums))
        means.append(sum(s for s, _ in picks) / sum(n for _, n in picks))
    means.sort()
    tail = (1 - confidence) / 2
    low = means[min(len(means) - 1, int(tail * len(means)))]
    high = means[min(len(means) - 1, int((1 - tail) * len(means)))]
    wins = sum(d > 0 for d in diff.values())
    losses = sum(d < 0 for d in diff.values())
    mean = sum(diff.values()) / len(keys)
    return PairedComparison(len(keys), mean, low, high, wins, losses, sign_test_p(wins, losses))
