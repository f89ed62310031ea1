"""Rollout engine: one batched ``generate`` call over every conversation of a turn.

Token-in/token-out: callers pass prompt token ids and get back the exact generated ids with the
log-probability of each under the sampling temperature; the update trains on these ids and never
re-tokenises text. The log-probs are the model's (``generate``'s raw logits over the temperature),
before top-p, top-k, min-p, the repetition penalty or ``generation_kwargs`` reshape them for sampling:
the distribution the update computes (see :class:`~lightning_memrl.settings.GenerationSettings`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor
from transformers.generation.logits_process import LogitsProcessorList

from lightning_memrl.errors import DataError
from lightning_memrl.logprobs import selected_logprobs
from lightning_memrl.rollout.attention import decode_attention
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.kv_cache import reserved_cache
from lightning_memrl.rollout.merged import MergedAdapters
from lightning_memrl.rollout.packed import PackedLinears
from lightning_memrl.rollout.prefix import (
    MIN_SHARED_PREFIX,
    left_pad,
    prefill_shared_prefixes,
    shared_prefix_groups,
    split_shared_prefixes,
)
from lightning_memrl.rollout.sampling import TokenDraw, warper
from lightning_memrl.settings import SAMPLING_ONLY, GenerationSettings
from lightning_memrl.types import Generation

NEUTRAL_PROCESSING: dict[str, Any] = {  # every generate option that changes the sampled distribution, set off
    "repetition_penalty": None,
    "encoder_repetition_penalty": None,
    "no_repeat_ngram_size": None,
    "encoder_no_repeat_ngram_size": None,
    "min_length": None,
    "min_new_tokens": None,
    "bad_words_ids": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "typical_p": None,
    "min_p": None,
    "top_h": None,
    "epsilon_cutoff": None,
    "eta_cutoff": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "num_beams": 1,
    "num_return_sequences": 1,
}


"""Passed to every ``generate`` call: ``generate`` fills an option the call leaves unset from the
model's ``generation_config`` (Qwen2.5-Instruct ships ``repetition_penalty: 1.05``), which would
sample from another distribution than the one whose log-probs are recorded and trained on."""


class SampledLogprobs:
    """The sampled tokens' log-probs, recorded while ``generate`` runs, from one step's logits at a time.

    ``generate(output_logits=True)`` would keep every step's fp32 ``[B, V]`` logits until it returns:
    ``S * B * V * 4`` bytes (6.4 GB for 64 rows of 512 tokens over a 49k vocabulary). A forward hook on
    the causal LM keeps only the last step's logits: the next forward's input is the token sampled from
    them, so that token's log-prob (:func:`~lightning_memrl.logprobs.selected_logprobs` of the raw logits
    over ``scale``, before any processor) is taken then and the logits dropped. The numbers are the
    ones ``output_logits`` gives (the same logits, cast to fp32 as ``generate`` casts them).

    Args:
        model: the model ``generate`` is called on (a peft wrapper included).
        scale: the sampling temperature (1 when greedy).
    """

    def __init__(self, model: Any, scale: float) -> None:
        self.lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # what generate calls
        self.scale = scale
        self.steps: list[Tensor] = []  # [B] log-probs of the tokens sampled so far, but the last
        self.last: Tensor | None = None  # [B, V] fp32 logits of the latest forward

    def __enter__(self) -> SampledLogprobs:
        self.handle = self.lm.register_forward_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()

    def _record(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        if self.last is not None:  # this forward's input is the token sampled from the last logits
            token = kwargs["input_ids"][:, -1].to(self.last.device)
            self.steps.append(selected_logprobs(self.last, token, self.scale))
        self.last = output.logits[:, -1].to(dtype=torch.float32, copy=True)

    def logprobs(self, new_ids: Tensor) -> Tensor:
        """``[B, S]`` log-probs of the ``S`` new tokens ``generate`` returned (steps it undid are dropped)."""
        steps = self.steps[: new_ids.shape[1]]
        if len(steps) < new_ids.shape[1]:  # the last token: sampled from the last forward's logits
            steps.append(selected_logprobs(self.last, new_ids[:, len(steps)].to(self.last.device), self.scale))
        self.last = None
        return torch.stack(steps, dim=1)


class RolloutEngine(RolloutBackend):
    """Batched sampling with left padding and the KV cache of ``model.generate``.

    Samples from ``model`` itself, in-process: with the live policy it needs no weight sync, except
    that a LoRA model's adapted layers run as plain layers over merged weights (``merge_adapters``),
    rebuilt after ``sync_weights`` and freed by ``release_memory``.
    Members of a group that share a prompt prefix share its KV cache: the prefix is prefilled once
    per group, copied to every member, and each member prefills only the rest of its prompt.

    Args:
        model: a causal LM (``transformers`` or a ``peft`` wrapper of one).
        tokenizer: its tokenizer; needs a pad token (EOS is used when it has none).
        share_prefixes: prefill shared prompt prefixes once (exact up to float rounding).
        min_shared_prefix: shortest shared prefix, in tokens, worth a separate prefill.
        merge_adapters: with LoRA, sample from merged copies of the adapted linear layers' weights
            (the plain model's speed; see :mod:`lightning_memrl.rollout.merged`). None (default):
            layers whose base weights are fp32, where merging is exact; bf16/fp16 bases keep their
            weights and add the adapters' products through
            :class:`~lightning_memrl.rollout.lowrank.LowRankStandIn` (peft's arithmetic, fewer
            operations); True: bf16/fp16 bases merged too (the merged weight rounded to their dtype);
            False: every layer through peft. Layers that cannot be merged (4-bit, FSDP-sharded, DoRA)
            always keep their adapters.
        pack_weights: on CPU, run the linear layers on weights pre-packed for oneDNN during a rollout
            (faster small-batch products, one extra copy of the weights while sampling; see
            :mod:`lightning_memrl.rollout.packed`). Merged LoRA weights are then held only packed.
            Layers it cannot serve keep their own forward.
        fold_decode_attention: on CPU in bf16/fp16, a decode step's grouped query heads attend as rows of
            their key/value head (:mod:`lightning_memrl.rollout.attention`: the same attention, 5-8x
            faster per call); the model must run ``sdpa``. False: ``sdpa`` as loaded.
        reserve_kv_cache: decode into a KV cache with room reserved for the new tokens, written in place
            (:mod:`lightning_memrl.rollout.kv_cache`); False: ``generate``'s own cache, which copies every
            layer's cache at every decode step.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        share_prefixes: bool = True,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
        merge_adapters: bool | None = None,
        pack_weights: bool = True,
        fold_decode_attention: bool = True,
        reserve_kv_cache: bool = True,
    ) -> None:
        self.model = model
        self.fold_decode_attention = fold_decode_attention
        self.reserve_kv_cache = reserve_kv_cache
        self.tokenizer = tokenizer
        self.share_prefixes = share_prefixes
        self.min_shared_prefix = min_shared_prefix
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.merged = (
            MergedAdapters(model, low_precision=bool(merge_adapters), pack_weights=pack_weights)
            if merge_adapters is not False
            else None
        )
        self.packed = PackedLinears(model) if pack_weights else None

    def sync_weights(self, model: Any) -> None:
        """``generate`` runs ``self.model``, the policy the optimizer updates in place: only merged
        LoRA weights are marked stale (rebuilt by the next ``generate``; packed weights are remade
        from any weight changed since they were packed)."""
        if self.merged:
            self.merged.invalidate()
        if self.packed is not None:
            self.packed.invalidate()

    def release_memory(self) -> None:
        """Free the merged LoRA and packed weights after a rollout (see :meth:`RolloutBackend.release_memory`)."""
        if self.merged:
            self.merged.release()
        if self.packed:
            self.packed.release()

    @contextmanager
    def sampling_weights(self) -> Iterator[None]:
        """Inside: the model samples from merged LoRA weights and packed linear layers, where enabled, and
        with folded decode-step attention."""
        with ExitStack() as stack:
            if self.fold_decode_attention:
                stack.enter_context(decode_attention(self.model))
            if self.merged:
                stack.enter_context(self.merged.swapped())
            if self.packed is not None:
                stack.enter_context(self.packed.swapped())  # after the merge: the merged stand-ins are packed too
            yield

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        max_new_tokens: int | None = None,
        prefix_labels: list[Any] | None = None,
        task_ids: list[str] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt, all prompts in one batch (see :meth:`RolloutBackend.generate`).

        Prompts with equal ``prefix_labels`` share a prefix (see :func:`shared_prefix_groups`);
        None detects groups among consecutive prompts. The prompt length check comes before
        anything is allocated: ``settings.max_prompt_length`` or the model's context minus
        ``max_new_tokens``, whichever is smaller.
        """
        if not prompts:
            return []
        max_new_tokens = max_new_tokens or settings.max_new_tokens
        self.check_prompt_lengths(prompts, settings, max_new_tokens, task_ids)
        with self.sampling_weights():  # LoRA: plain layers over merged weights; CPU: packed weights
            input_ids, attention_mask, cache = self._prefill(prompts, prefix_labels, max_new_tokens)
            kwargs = self._generate_kwargs(settings, max_new_tokens)
            if cache is not None:
                kwargs["cache"] = cache  # generate feeds only the columns after the cache
            scale = settings.temperature if settings.temperature > 0 else 1.0
            with SampledLogprobs(self.model, scale) as recorder:
                out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        new_ids = out.sequences[:, input_ids.shape[1] :]  # [B, S]
        token_logprobs = recorder.logprobs(new_ids).cpu()  # [B, S]
        new_ids = new_ids.cpu()
        return [self._cut(new_ids[row], token_logprobs[row], settings) for row in range(len(prompts))]

    def _prefill(
        self, prompts: list[list[int]], prefix_labels: list[Any] | None, max_new_tokens: int
    ) -> tuple[Tensor, Tensor, Any]:
        """``input_ids`` and ``attention_mask`` [B, P] of the prompts, and the KV cache ``generate`` continues:
        the shared prefixes' when a group shares one worth a separate prefill; else an empty reserved
        cache, or None (``generate`` makes its own) with ``reserve_kv_cache`` off."""
        device = next(self.model.parameters()).device
        groups = shared_prefix_groups(prompts, self.min_shared_prefix, prefix_labels) if self.share_prefixes else []
        cache = reserved_cache(room=max_new_tokens) if self.reserve_kv_cache else None
        if not any(len(rows) > 1 for _, rows in groups):
            return (*left_pad(prompts, self.pad_id, device), cache)
        layout = split_shared_prefixes(prompts, groups, self.pad_id, device)
        kwargs = {"cache": cache} if cache is not None else {}
        cache = prefill_shared_prefixes(self.model, layout, logits_to_keep=1, **kwargs)  # only the KV cache
        return layout.row_ids, layout.row_mask, cache

    def _generate_kwargs(self, settings: GenerationSettings, max_new_tokens: int) -> dict[str, Any]:
        """Options of ``model.generate``: only the settings' options shape the distribution (temperature,
        top-p, top-k, min-p, repetition penalty and ``generation_kwargs``; the rest is switched off)."""
        greedy = settings.temperature <= 0
        kwargs: dict[str, Any] = {
            **NEUTRAL_PROCESSING,
            "max_new_tokens": max_new_tokens,
            "do_sample": not greedy,
            "pad_token_id": self.pad_id,
            "eos_token_id": sorted(self.eos_ids),
            "return_dict_in_generate": True,
            "output_logits": False,  # SampledLogprobs scores each token as it is sampled
            "use_cache": True,
        }
        if greedy:  # neutral values so a model's generation_config does not warn or sample
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if settings.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = settings.repetition_penalty
        if settings.stop_strings:
            kwargs.update(stop_strings=list(settings.stop_strings), tokenizer=self.tokenizer)
        extra = {k: v for k, v in (settings.generation_kwargs or {}).items() if not (greedy and k in SAMPLING_ONLY)}
        processors = [] if greedy else [warper(settings)]  # generate's own warpers would run before a custom one
        processors += extra.pop("logits_processor", None) or []  # the user's after the warpers
        if not greedy and not SAMPLING_ONLY.intersection(extra):  # generate samples those warpers only itself
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)  # greedy takes TokenDraw's token
            processors.append(TokenDraw())
        elif not greedy:  # generate draws (torch.multinomial) after the warpers it adds for those options
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0)  # temperature comes with our warper
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList(processors)
        kwargs.update(extra)  # checked when parsed: no key of the above (GenerationSettings.generation_kwargs)
        return kwargs

    def prompt_limit(self, settings: GenerationSettings, max_new_tokens: int) -> tuple[int | None, str]:
        """Longest prompt a turn may have, and where that limit comes from (None: no limit known)."""
        context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        room = context - max_new_tokens if isinstance(context, int) else None
        limit = settings.max_prompt_length
        if limit is not None and (room is None or limit <= room):
            return limit, f"generation.max_prompt_length={limit}"
        if room is None:
            return None, ""
        return room, f"the model's max_position_embeddings={context} minus {max_new_tokens} new tokens"

    def check_prompt_lengths(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        max_new_tokens: int,
        task_ids: list[str] | None = None,
    ) -> None:
        """Raise a DataError naming the task of the longest prompt over :meth:`prompt_limit`."""
        limit, source = self.prompt_limit(settings, max_new_tokens)
        longest = max(range(len(prompts)), key=lambda row: len(prompts[row]))
        if limit is None or len(prompts[longest]) <= limit:
            return
        task = f"task {task_ids[longest]!r}" if task_ids else f"prompt {longest} of this turn"
        raise DataError(
            f"{task}: a prompt of {len(prompts[longest])} tokens is longer than the limit of {limit} tokens "
            f"({source}). Shorten that task's question or context (or lower the workflow's chunk_tokens), "
            "or set model.init_args.generation.max_prompt_length within the model's context."
        )

    def _cut(self, ids: Tensor, logprobs: Tensor, settings: GenerationSettings) -> Generation:
        """Keep a row's tokens up to its first EOS or stop string (inclusive)."""
        ids_list = ids.tolist()
        for pos, tok in enumerate(ids_list):
            if tok in self.eos_ids:
                return Generation(ids_list[: pos + 1], logprobs[: pos + 1].clone(), False)
        if settings.stop_strings:
            end = self._stop_string_end(ids_list, settings.stop_strings)
            if end is not None:
                return Generation(ids_list[:end], logprobs[:end].clone(), False)
        return Generation(ids_list, logprobs.clone(), True)

    def _stop_string_end(self, ids: list[int], stop_strings: list[str]) -> int | None:
        """Smallest prefix length whose decoded text contains a stop string."""
        for end in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:end], skip_special_tokens=False)
            if any(s in text for s in stop_strings):
                return end
        return None
