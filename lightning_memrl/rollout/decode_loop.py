"""A rollout backend with its own decode loop: ``model.generate``'s sampling without its per-token machinery.

:class:`DecodeLoopEngine` is :class:`~lightning_memrl.rollout.hf.RolloutEngine` (the same prompt
checks, shared-prefix prefill, merged LoRA weights, EOS handling and cutting) with ``model.generate``
replaced by a plain loop: one prefill, then one forward of one token per row and step that computes
only the last position's logits (``logits_to_keep=1``), with explicit position ids and an attention
mask grown by one column. ``generate`` spends, per token, time on its logits processors, stopping
criteria, mask and cache bookkeeping and output tuples that the loop does not.

* ``cache="static"``: a ``transformers`` ``StaticCache`` sized to the prompt plus ``max_new_tokens``
  (written in place, no concatenation per step); ``"dynamic"``: the default ``DynamicCache``.
* ``drop_finished``: a row that has emitted EOS leaves the decode batch (its cache rows too), so it
  costs no more decode work; ``generate`` keeps decoding it on padding until every row is done.
No ``torch.compile`` option: on CPU, inductor cannot lower the oneDNN-packed weights, and a compiled step
over the plain layers (static cache reused across calls, fixed shapes) is only as fast as the eager step on
packed weights (SmolLM2-135M, 2 threads: bf16 39.9 vs 38.8 ms, fp32 68.4 vs 68.2 ms) after 27-37 s of
cold warm-up per shape (``benchmarks/decode.py --compile``).

Sampling is the default engine's: the raw fp32 logits of the last position go through ``transformers``'
own ``RepetitionPenaltyLogitsProcessor`` (padding columns ignored as ``generate`` does), then, when
sampling, :class:`~lightning_memrl.rollout.sampling.CandidateWarper` (``generate``'s temperature,
top-k, top-p and min-p, in that order), then :func:`~lightning_memrl.rollout.sampling.draw_tokens` (greedy:
``argmax``). The recorded
log-prob of a token is :func:`~lightning_memrl.logprobs.selected_logprobs` of the raw logits under the
temperature, as the parent records it. Settings the loop does not implement (``generation_kwargs``,
``stop_strings``) run that call through ``RolloutEngine.generate`` (counted in :attr:`fallbacks`, and
logged the first time for each reason).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import DynamicCache, StaticCache
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from lightning_memrl.errors import ConfigError
from lightning_memrl.logprobs import selected_logprobs
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.prefix import (
    MIN_SHARED_PREFIX,
    left_pad,
    position_ids,
    prefill_shared_prefixes,
    shared_prefix_groups,
    split_shared_prefixes,
)
from lightning_memrl.rollout.sampling import draw_tokens, warper
from lightning_memrl.settings import SAMPLING_ONLY, GenerationSettings
from lightning_memrl.types import Generation

log = logging.getLogger(__name__)

CacheKind = Literal["static", "dynamic"]


class DecodeLoopEngine(RolloutEngine):
    """:class:`~lightning_memrl.rollout.hf.RolloutEngine` with its own decode loop in place of ``model.generate``.

    Args:
        model: a causal LM (``transformers`` or a ``peft`` wrapper of one).
        tokenizer: its tokenizer; needs a pad token (EOS is used when it has none).
        share_prefixes: prefill shared prompt prefixes once (exact up to float rounding).
        min_shared_prefix: shortest shared prefix, in tokens, worth a separate prefill.
        merge_adapters: with LoRA, sample from merged weights (see ``RolloutEngine``).
        pack_weights: on CPU, linear layers on oneDNN-packed weights while sampling (see ``RolloutEngine``).
        fold_decode_attention: on CPU in bf16/fp16, folded decode-step attention (see ``RolloutEngine``).
        cache: ``static`` (a ``StaticCache`` sized to prompt + ``max_new_tokens``, written in place)
            or ``dynamic`` (``DynamicCache``, grown by concatenation).
        drop_finished: take rows that have emitted EOS out of the decode batch (and the cache).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        share_prefixes: bool = True,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
        merge_adapters: bool | None = None,
        cache: CacheKind = "static",
        drop_finished: bool = True,
        pack_weights: bool = True,
        fold_decode_attention: bool = True,
    ) -> None:
        super().__init__(
            model, tokenizer, share_prefixes, min_shared_prefix, merge_adapters, pack_weights, fold_decode_attention
        )
        if cache not in ("static", "dynamic"):
            raise ConfigError(f"model.init_args.rollout.init_args.cache must be 'static' or 'dynamic' (got {cache!r})")
        self.cache = cache
        self.drop_finished = drop_finished
        self.fallbacks: dict[str, int] = {}  # reason -> calls run through RolloutEngine.generate

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        max_new_tokens: int | None = None,
        prefix_labels: list[Any] | None = None,
        task_ids: list[str] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt with the decode loop (see :meth:`RolloutBackend.generate`)."""
        if not prompts:
            return []
        reason = self.unsupported(settings)
        if reason:
            self._count_fallback(reason)
            return super().generate(prompts, settings, max_new_tokens, prefix_labels, task_ids)
        max_new_tokens = max_new_tokens or settings.max_new_tokens
        self.check_prompt_lengths(prompts, settings, max_new_tokens, task_ids)
        with self.sampling_weights():  # LoRA: plain layers over merged weights; CPU: packed weights
            new_ids, token_logprobs = self._decode(prompts, settings, max_new_tokens, prefix_labels)
        return [self._cut(new_ids[row], token_logprobs[row], settings) for row in range(len(prompts))]

    def unsupported(self, settings: GenerationSettings) -> str | None:
        """The setting the loop does not implement (that call runs ``model.generate``), or None."""
        greedy = settings.temperature <= 0
        extra = {k for k in settings.generation_kwargs or {} if not (greedy and k in SAMPLING_ONLY)}
        if extra:
            return f"generation_kwargs ({', '.join(sorted(extra))})"
        if settings.stop_strings:
            return "stop_strings"
        return None

    def _count_fallback(self, reason: str) -> None:
        key = reason.split(" ")[0]
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1
        if self.fallbacks[key] == 1:
            log.warning(
                "DecodeLoopEngine: %s not implemented by the decode loop; these rollouts run model.generate "
                "(RolloutEngine), counted in engine.fallbacks",
                reason,
            )

    def _decode(
        self, prompts: list[list[int]], settings: GenerationSettings, max_new_tokens: int, prefix_labels: Any
    ) -> tuple[Tensor, Tensor]:
        """Generated ids [B, S] (padding after a row's EOS) and their log-probs [B, S], on the CPU."""
        device = next(self.model.parameters()).device
        ids, mask, cache, cached = self._prefill_inputs(prompts, prefix_labels, max_new_tokens, device)
        rows, width = ids.shape
        full_mask = torch.zeros(rows, self._cache_len(width, max_new_tokens), dtype=mask.dtype, device=device)
        full_mask[:, :width] = mask
        positions = position_ids(mask)
        out = self.model(
            input_ids=ids[:, cached:],
            attention_mask=full_mask if self.cache == "static" else mask,
            position_ids=positions[:, cached:],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float()  # the cache was filled in place
        sampler = _Sampler(settings, ids, mask)
        scale = settings.temperature if settings.temperature > 0 else 1.0
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)
        new_ids = torch.full((rows, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(rows, max_new_tokens, device=device)
        active = torch.arange(rows, device=device)  # the decode batch's rows, as rows of the output
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)  # without dropping: rows still running
        next_pos = positions[:, -1] + 1
        for step in range(max_new_tokens):
            tokens = sampler.choose(logits)
            if not self.drop_finished:
                tokens = torch.where(unfinished, tokens, self.pad_id)  # as generate: padding after EOS
            new_ids[active, step] = tokens
            logprobs[active, step] = selected_logprobs(logits, tokens, scale)
            finished = torch.isin(tokens, eos)
            if step == max_new_tokens - 1:
                break
            sampler.append(tokens)
            if self.drop_finished and bool(finished.any()):
                keep = (~finished).nonzero().squeeze(1)
                if keep.numel() == 0:
                    break
                active, tokens, next_pos, full_mask = active[keep], tokens[keep], next_pos[keep], full_mask[keep]
                cache.reorder_cache(keep)  # the finished rows' keys and values are dropped
                sampler.select(keep)
            elif not self.drop_finished:
                unfinished &= ~finished
                if not bool(unfinished.any()):
                    break
            full_mask[:, width + step] = 1
            step_mask = full_mask if self.cache == "static" else full_mask[:, : width + step + 1]
            logits = self._step(tokens[:, None], step_mask, next_pos[:, None], cache).float()
            next_pos = next_pos + 1
        return new_ids.cpu(), logprobs.cpu()

    def _step(self, tokens: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One decode forward: the next-token logits [b, V] of one new token [b, 1] per row."""
        out = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1]

    def _cache_len(self, width: int, max_new_tokens: int) -> int:
        """Columns the cache (and the full attention mask) holds: prompt + new tokens."""
        return width + max_new_tokens

    def _new_cache(self, length: int) -> Any:
        if self.cache == "static":
            return StaticCache(config=self.model.config, max_cache_len=length)
        return DynamicCache(config=self.model.config)

    def _prefill_inputs(
        self, prompts: list[list[int]], prefix_labels: Any, max_new_tokens: int, device: torch.device
    ) -> tuple[Tensor, Tensor, Any, int]:
        """``input_ids`` and ``attention_mask`` [B, P], a cache holding the shared prefixes (empty when no two
        prompts share one worth a separate prefill), and how many columns that cache already holds."""
        groups = shared_prefix_groups(prompts, self.min_shared_prefix, prefix_labels) if self.share_prefixes else []
        if not any(len(rows) > 1 for _, rows in groups):
            ids, mask = left_pad(prompts, self.pad_id, device)
            return ids, mask, self._new_cache(self._cache_len(ids.shape[1], max_new_tokens)), 0
        layout = split_shared_prefixes(prompts, groups, self.pad_id, device)
        cache = self._new_cache(self._cache_len(layout.row_ids.shape[1], max_new_tokens))
        prefill_shared_prefixes(self.model, layout, cache=cache, logits_to_keep=1)  # [G] rows copied to [B]
        return layout.row_ids, layout.row_mask, cache, layout.prefix_ids.shape[1]


class _Sampler:
    """The default engine's token choice: ``generate``'s processors and warpers over the raw logits, then
    :func:`~lightning_memrl.rollout.sampling.draw_tokens` or argmax.

    Keeps the sequences so far (prompt columns included, as ``generate`` passes them to its
    processors) only when the repetition penalty needs them.
    """

    def __init__(self, settings: GenerationSettings, ids: Tensor, mask: Tensor) -> None:
        self.greedy = settings.temperature <= 0
        self.processors = LogitsProcessorList()
        self.penalty: RepetitionPenaltyLogitsProcessor | None = None
        self.sequences: Tensor | None = None
        if settings.repetition_penalty != 1.0:  # generate ignores each row's left padding
            self.penalty = RepetitionPenaltyLogitsProcessor(
                float(settings.repetition_penalty), prompt_ignore_length=(mask != 0).int().argmax(dim=1)
            )
            self.processors.append(self.penalty)
            self.sequences = ids
        if not self.greedy:  # generate's temperature, top-k, top-p and min-p, as the default engine runs them
            self.processors.append(warper(settings))

    def choose(self, logits: Tensor) -> Tensor:
        """Next token [b] from the raw fp32 logits [b, V] (left unchanged)."""
        scores = self.processors(self.sequences, logits) if self.processors else logits  # out of place
        if self.greedy:
            return scores.argmax(-1)
        return draw_tokens(scores)

    def append(self, tokens: Tensor) -> None:
        if self.sequences is not None:
            self.sequences = torch.cat([self.sequences, tokens[:, None]], dim=1)

    def select(self, keep: Tensor) -> None:
        """Keep only rows ``keep`` (the others left the decode batch)."""
        if self.sequences is not None:
            self.sequences = self.sequences[keep]
            self.penalty.prompt_ignore_length = self.penalty.prompt_ignore_length[keep]
