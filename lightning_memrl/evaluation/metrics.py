"""Answer metrics of the evaluation report: BLEU-1 and evidence recall (exact match and F1 live in rewards).

BLEU-1 is the one that LoCoMo memory papers report as B1 (A-Mem, Mem0, Memory-R1 share its scorer):
nltk's ``sentence_bleu`` with weights ``(1, 0, 0, 0)`` and smoothing ``method1`` over nltk word tokens of
the lower-cased texts, punctuation and articles kept. It is clipped unigram precision times the
brevity penalty; the smoothing only keeps nltk from taking ``log(0)`` of the unused higher orders.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _nltk() -> tuple[Any, Any, Any, Any]:
    """nltk's sentence splitter, word tokenizer, ``sentence_bleu`` and smoothing (imported on first use)."""
    from nltk.tokenize import NLTKWordTokenizer, PunktSentenceTokenizer
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    # Punkt with its default parameters: the trained English model is a separate nltk download
    # (``punkt_tab``), which would make scores depend on what a machine has downloaded.
    return PunktSentenceTokenizer(), NLTKWordTokenizer(), sentence_bleu, SmoothingFunction().method1


def bleu_tokens(text: str) -> list[str]:
    """Lower-cased nltk word tokens of ``text``: ``nltk.word_tokenize`` (Punkt sentences, then Treebank words)."""
    sentences, tokenizer, _, _ = _nltk()
    return [token for sentence in sentences.tokenize(str(text).lower()) for token in tokenizer.tokenize(sentence)]


def bleu1(prediction: str, answers: list[str]) -> float:
    """Best BLEU-1 of ``prediction`` over the gold ``answers`` (0.0 when it or every answer has no token).

    ``BLEU-1 = min(1, exp(1 - r / c)) * clipped unigram matches / c`` for a prediction of ``c`` tokens and a
    reference of ``r``, computed by ``nltk.translate.bleu_score.sentence_bleu`` (see the module docstring).
    """
    _, _, sentence_bleu, smoothing = _nltk()
    pred = bleu_tokens(prediction)
    if not pred:
        return 0.0
    scores = [
        float(sentence_bleu([ref], pred, weights=(1, 0, 0, 0), smoothing_function=smoothing))
        for ref in map(bleu_tokens, answers)
        if ref
    ]
    return max(scores, default=0.0)


def evidence_recall(retrieved_source_ids: list[str] | set[str], evidence: list[str]) -> float | None:
    """Share of the ``evidence`` ids found among the source ids of what was retrieved (None: no evidence)."""
    if not evidence:
        return None
    shown = set(retrieved_source_ids)
    return sum(e in shown for e in evidence) / len(evidence)
