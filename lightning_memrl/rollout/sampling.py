"""``generate``'s temperature, top-k, top-p and min-p in one logits warper that need not sort the vocabulary.

``transformers``' ``TopPLogitsWarper`` sorts every row of the ``[B, V]`` scores at every decode step:
over SmolLM2's 49 152 tokens, 8 rows, 2 CPU threads, 16-18 ms a step, a tenth of a bf16 MemAgent
rollout (``torch.profiler``: 2.5 s of ``aten::sort`` in a 21 s rollout). The nucleus of a language
model's next-token distribution holds few tokens, so :class:`CandidateWarper` takes the ``candidates``
largest scores of each row (``topk``) and computes the nucleus among them: 2.3-3.0 ms on such rows.
When the candidates hold less than ``top_p`` of a row's probability (a flat row, e.g. an untrained
model's), it sorts the whole rows instead (then it costs 1.2-1.5x the sort: 20-24 ms). The
normaliser and the sums near ``top_p`` are taken in float64: with either in fp32 the kept set differed
from the exact one at ``top_p=0.999`` (the sorted warper sums from the bottom, which is accurate).

What it keeps is what ``generate``'s warpers keep, in their order (temperature, top-k, top-p,
min-p), with ``min_tokens_to_keep=1``:

* temperature: ``s / T``;
* top-k: the ``k`` largest scores (``generate`` also keeps tokens tied with the ``k``-th; on such a
  tie this warper hands the batch to ``generate``'s own warpers);
* top-p: token ``i`` stays when the probability of the tokens more likely than it is below ``p``,
  ``sum_{j: s_j > s_i} softmax(s)_j < p`` (``TopPLogitsWarper`` removes a token when the probability
  of it and every less likely token is at most ``1 - p``: the same set, summed from the other end, so
  a token exactly at the boundary can differ by float rounding), the most likely always;
* min-p: token ``i`` stays when ``softmax(s)_i >= min_p * max softmax(s)``, i.e.
  ``s_i - s_max >= log(min_p)``.

Removed tokens get ``-inf``, so ``softmax`` and ``torch.multinomial`` draw from the same distribution,
and with the same seed the same tokens, as after ``generate``'s warpers.

The draw itself: ``torch.multinomial`` on CPU draws one exponential variate per vocabulary entry (a
row of 49 152 for one token): 8-11 ms for 8 rows at 2 threads, a sixth of an fp32 SmolLM2 decode
step. :func:`draw_tokens` draws from the same probabilities by inverting their cumulative sum (one
uniform per row, the sums in float64): 0.3 ms. :class:`TokenDraw` does it as the last logits
processor of a greedy ``generate``, which then takes the drawn token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lightning_memrl.settings import GenerationSettings

CANDIDATES = 1024  # first look at this many tokens per row (top-p needs more on a flat row)


class CandidateWarper:
    """Temperature, top-k, top-p and min-p of ``generate`` on each row's most likely tokens (see the module).

    Args:
        temperature: divides the scores (> 0).
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus mass (1.0: off).
        min_p: keep tokens at least this fraction of the most likely one's probability (0: off).
        candidates: tokens per row looked at first.
    """

    def __init__(
        self, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, candidates: int = CANDIDATES
    ) -> None:
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.candidates = candidates
        self.fallbacks = 0  # batches handed to generate's warpers for a tied top-k boundary

    def __call__(self, input_ids: Tensor | None, scores: Tensor) -> Tensor:
        """The warped scores [B, V] (a new tensor) of ``scores`` [B, V]."""
        scores = scores / self.temperature
        if not (self.top_k or self.top_p < 1.0):  # min-p alone sorts nothing: generate's warper
            return self._generate_warpers()(input_ids, scores) if self.min_p else scores
        values, index, kept = self._kept_candidates(scores)  # [B, K] each
        if values is None:
            self.fallbacks += 1
            return self._generate_warpers()(input_ids, scores)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, index, kept)
        return scores.masked_fill(~keep, -math.inf)

    def _kept_candidates(self, scores: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The candidates' scores and token ids [B, K] (most likely first) and which are kept [B, K];
        (None, None, None) when a row's k-th score is tied with a token past it."""
        vocab = scores.shape[-1]
        count = min(self.top_k, vocab) if self.top_k else min(self.candidates, vocab)
        while True:
            values, index = scores.topk(count, dim=-1)  # [B, K], most likely first
            if self.top_k and count < vocab and bool(((scores >= values[:, -1:]).sum(-1) > count).any()):
                return None, None, None
            kept = torch.ones_like(values, dtype=torch.bool)
            reaches_past = torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)  # [B]
            if self.top_p < 1.0:  # softmax over what top-k kept (the whole row without top-k)
                whole = values if self.top_k else scores  # float64: the sums near top_p as exact as the sorted ones
                probs = (values.double() - whole.double().logsumexp(-1, keepdim=True)).exp()  # [B, K]
                cumulative = probs.cumsum(-1)
                kept = (cumulative - probs) < self.top_p  # the more likely tokens hold less than top_p
                reaches_past = cumulative[:, -1] < self.top_p  # then the next token is in the nucleus too
            if self.min_p:
                kept &= values - values[:, :1] >= math.log(self.min_p)
                reaches_past = reaches_past if self.top_p < 1.0 else kept[:, -1]
            if not self.top_k and count < vocab and bool(reaches_past.any()):
                count = vocab  # a flat row: its nucleus is most of the vocabulary, so sort it all
                continue
            kept[:, 0] = True
            return values, index, kept

    def _generate_warpers(self) -> LogitsProcessorList:
        """``generate``'s own top-k, top-p and min-p warpers (temperature already applied)."""
        warpers = LogitsProcessorList()
        if self.top_k:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p:
            warpers.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return warpers


def draw_tokens(scores: Tensor) -> Tensor:
    """One token per row drawn from ``softmax(scores)`` by inverting its cumulative sum: ``[B]`` token ids.

    Exact for the fp32 probabilities ``torch.multinomial`` would draw from: a uniform ``u`` in [0, 1)
    per row (``torch.rand``, so ``torch.manual_seed`` makes it repeatable), and the first token whose
    cumulative probability exceeds ``u`` times the row's total; a token of probability 0 (score
    ``-inf``) is never drawn. The cumulative sums are float64, so rounding does not shift the mass of
    a 49k-token row. Not the random stream of ``torch.multinomial``: the same seed draws other tokens.

    Args:
        scores: ``[B, V]`` scores after every processor and warper.
    """
    cumulative = torch.softmax(scores.float(), dim=-1).cumsum(-1, dtype=torch.float64)  # [B, V]
    total = cumulative[:, -1:].contiguous()  # [B, 1], 1 up to rounding
    target = torch.rand(scores.shape[0], 1, dtype=torch.float64, device=scores.device) * total
    drawn = torch.searchsorted(cumulative, target, right=True)  # first index with cumulative > target
    last_possible = torch.searchsorted(cumulative, total)  # where the total is reached: the last token of p > 0
    return torch.minimum(drawn, last_possible).squeeze(1)  # u * total rounded up to the total: that token


class TokenDraw:
    """The last logits processor of a greedy ``generate``: draws each row's token (:func:`draw_tokens`) and
    returns scores that are 0 there and ``-inf`` elsewhere, so ``generate``'s ``argmax`` takes it."""

    def __call__(self, input_ids: Tensor | None, scores: Tensor) -> Tensor:
        tokens = draw_tokens(scores)  # [B]
        return torch.full_like(scores, -math.inf).scatter_(1, tokens[:, None], 0.0)


def warper(settings: GenerationSettings) -> CandidateWarper:
    """The warper of a sampling ``settings``' temperature, top-k, top-p and min-p."""
    return CandidateWarper(settings.temperature, settings.top_k, settings.top_p, settings.min_p or 0.0)
