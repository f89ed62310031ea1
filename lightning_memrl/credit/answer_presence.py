"""Is the gold answer in a text? The memory checks that several credit methods share.

Both compare SQuAD-normalised text (:func:`~lightning_memrl.rewards.normalize_answer`: lower case,
no punctuation, no articles), word by word, so "10" is not found in "100".
"""

from __future__ import annotations

from lightning_memrl.rewards import normalize_answer


def holds_answer(text: str, answers: list[str]) -> bool:
    """True when one gold answer occurs in ``text`` as a whole run of words."""
    padded = f" {normalize_answer(text)} "
    return any(f" {a} " in padded for a in map(normalize_answer, answers) if a)


def answer_word_recall(text: str, answers: list[str]) -> float:
    """Largest fraction, over the gold answers, of an answer's words that occur in ``text``.

    ``rec(text) = max_a |words(a) ∩ words(text)| / |words(a)|``; 0.0 when no answer has a word.
    """
    words = set(normalize_answer(text).split())
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        if gold:
            best = max(best, sum(w in words for w in gold) / len(gold))
    return best
