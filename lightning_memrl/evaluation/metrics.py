"""Answer metrics of the evaluation report: BLEU-1 and evidence recall (exact match and F1 live in rewards)."""

from __future__ import annotations

import math
from collections import Counter

from lightning_memrl.rewards import normalize_answer


def bleu1(prediction: str, answers: list[str]) -> float:
    """Best BLEU-1 over gold answers: clipped unigram precision × brevity penalty (SQuAD-normalised words).

    ``BP = 1`` when the prediction is longer than the reference, else ``exp(1 - r / c)``.
    """
    pred = normalize_answer(prediction).split()
    if not pred:
        return 0.0
    best = 0.0
    for answer in answers:
        ref = normalize_answer(answer).split()
        if not ref:
            continue
        overlap = sum((Counter(pred) & Counter(ref)).values())
        brevity = 1.0 if len(pred) > len(ref) else math.exp(1 - len(ref) / len(pred))
        best = max(best, brevity * overlap / len(pred))
    return best


def evidence_recall(retrieved_source_ids: list[str] | set[str], evidence: list[str]) -> float | None:
    """Share of the ``evidence`` ids found among the source ids of what was retrieved (None: no evidence)."""
    if not evidence:
        return None
    shown = set(retrieved_source_ids)
    return sum(e in shown for e in evidence) / len(evidence)
