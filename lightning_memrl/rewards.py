"""Answer extraction, SQuAD-style scoring and the reward functions chosen in YAML.

A reward function is a callable ``(trajectory) -> float | None`` with a ``name`` and a ``weight``:
it sees the whole :class:`~lightning_memrl.types.Trajectory` (task, turns, memories, chunks, info),
and one that only judges the final answer implements :meth:`RewardFunction.score_answer`
``(completion, answers)``. ``None`` means "cannot score this one"; a trajectory that every function
leaves unscored gets a NaN reward, which the advantage leaves out of its group's baseline.
"""

from __future__ import annotations

import inspect
import re
import string
from collections import Counter
from typing import NamedTuple

from lightning_memrl.types import Trajectory

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in ``text`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def sub_exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 when a normalised gold answer occurs inside the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(a) and normalize_answer(a) in pred for a in answers))


def token_f1(prediction: str, answers: list[str]) -> float:
    """Best SQuAD token F1 of the prediction against the gold answers."""
    return token_scores(prediction, answers).f1


class TokenScores(NamedTuple):
    """SQuAD token overlap of a prediction with one gold answer."""

    f1: float
    precision: float  # shared tokens / the prediction's tokens
    recall: float  # shared tokens / the gold answer's tokens


def token_scores(prediction: str, answers: list[str]) -> TokenScores:
    """Token F1, precision and recall against the gold answer with the best F1 (SQuAD normalisation; shared
    tokens counted with multiplicity). Two sides that both normalise to nothing score 1, one empty side 0."""
    pred_tokens = normalize_answer(prediction).split()
    best = TokenScores(0.0, 0.0, 0.0)
    for answer in answers:
        gold_tokens = normalize_answer(answer).split()
        if not pred_tokens or not gold_tokens:
            same = float(pred_tokens == gold_tokens)
            best = max(best, TokenScores(same, same, same))
            continue
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common:
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            best = max(best, TokenScores(2 * precision * recall / (precision + recall), precision, recall))
    return best


def answer_from_completion(completion: str, answer_pattern: str | None = None) -> str:
    r"""The answer a completion gives.

    Its last ``\boxed{}`` content, else the whole text. With ``answer_pattern`` (a regular
    expression) the answer is the pattern's first match in the boxed content or text (its first
    group when it has one), and ``""`` when nothing matches.

    Args:
        completion: the decoded final response.
        answer_pattern: e.g. ``\b\d{4}\b`` for a four-digit code; None keeps the whole answer.
    """
    boxed = extract_boxed(completion)
    answer = boxed if boxed is not None else completion.strip()
    if answer_pattern is None:
        return answer
    match = re.search(answer_pattern, answer)
    if match is None:
        return ""
    return (match.group(1) if match.groups() else match.group(0)).strip()


def check_answer_pattern(answer_pattern: str | None, option: str) -> None:
    """Fail early, naming ``option``, when ``answer_pattern`` is not a valid regular expression."""
    if answer_pattern is None:
        return
    try:
        re.compile(answer_pattern)
    except re.error as err:
        raise ValueError(f"{option}: {answer_pattern!r} is not a valid regular expression ({err})") from err


class RewardFunction:
    r"""Base of reward functions: override :meth:`score` (reads the trajectory) or :meth:`score_answer`.

    :meth:`score` receives the :class:`~lightning_memrl.types.Trajectory` (its task, turns,
    memories, chunks and info); by default it scores the final turn's text against the task's gold
    answers with :meth:`score_answer`, which answer-only rewards implement.

    Args:
        weight: multiplies the score before the weighted sum over reward functions.
        name: key under which the score is logged (``train/reward/<name>``).
        answer_pattern: regular expression that picks the answer out of the completion (see
            :func:`answer_from_completion`); None scores the whole ``\boxed{}`` content or text.
    """

    default_name = "reward"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        score = cls.__dict__.get("score")
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [] if score is None else inspect.signature(score).parameters.values()
        if len([p for p in required if p.kind in positional and p.default is p.empty]) > 2:
            raise TypeError(
                f"{cls.__qualname__}.score takes more than the trajectory: score(self, trajectory) receives the "
                "Trajectory; rename a score(self, completion, answers) method to score_answer"
            )

    def __init__(self, weight: float = 1.0, name: str | None = None, answer_pattern: str | None = None) -> None:
        self.weight = weight
        self.name = name or self.default_name
        check_answer_pattern(answer_pattern, f"reward {self.name}: answer_pattern")
        self.answer_pattern = answer_pattern

    def answer(self, completion: str) -> str:
        """The answer this function scores (:func:`answer_from_completion` with its pattern)."""
        return answer_from_completion(completion, self.answer_pattern)

    def score(self, trajectory: Trajectory) -> float | None:
        """Score one trajectory (default: :meth:`score_answer` of its final text and gold answers)."""
        return self.score_answer(trajectory.final_text, trajectory.task.answers)

    def score_answer(self, completion: str, answers: list[str]) -> float | None:
        """Score one final completion against its gold answers."""
        raise NotImplementedError(
            f"{type(self).__name__}: implement score(trajectory) or score_answer(completion, answers)"
        )

    def __call__(self, trajectory: Trajectory) -> float | None:
        return self.score(trajectory)


class ExactMatch(RewardFunction):
    r"""Exact match of the ``\boxed{}`` answer (whole completion if none).

    Args:
        require_boxed: score 0 when the completion has no ``\boxed{}`` (MemAgent's rule).
        weight: weight in the sum of reward functions.
        name: log key.
        answer_pattern: regular expression that picks the answer out (None: the whole answer).
    """

    default_name = "exact_match"

    def __init__(
        self,
        require_boxed: bool = False,
        weight: float = 1.0,
        name: str | None = None,
        answer_pattern: str | None = None,
    ) -> None:
        super().__init__(weight, name, answer_pattern)
        self.require_boxed = require_boxed

    def score_answer(self, completion: str, answers: list[str]) -> float | None:
        if self.require_boxed and extract_boxed(completion) is None:
            return 0.0
        return exact_match(self.answer(completion), answers)


class SubExactMatch(RewardFunction):
    """A gold answer appears inside the extracted answer."""

    default_name = "sub_em"

    def score_answer(self, completion: str, answers: list[str]) -> float | None:
        return sub_exact_match(self.answer(completion), answers)


class TokenF1(RewardFunction):
    """SQuAD token F1 of the extracted answer."""

    default_name = "f1"

    def score_answer(self, completion: str, answers: list[str]) -> float | None:
        return token_f1(self.answer(completion), answers)


class BoxedFormat(RewardFunction):
    r"""1.0 when the completion contains exactly one non-empty ``\boxed{}``, else 0.0."""

    default_name = "format"

    def score_answer(self, completion: str, answers: list[str]) -> float | None:
        boxed = extract_boxed(completion)
        return float(boxed is not None and bool(boxed) and completion.count("\\boxed{") == 1)
