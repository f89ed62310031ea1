"""Shared-prompt-prefix utilities, used by the rollout engine and by the learner's forward.

Members of a GRPO group share their prompt's first part (MemAgent: the problem and the chunk). A
causal model's states over that prefix do not depend on what follows, so it is computed once per
group: :func:`shared_prefix_groups` finds the groups, :func:`split_shared_prefixes` lays rows out as
``[pad prefix][pad rest]``, and :func:`prefill_shared_prefixes` runs the prefixes and copies their KV
cache to every member.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask`` of shape [B, P]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: Tensor) -> Tensor:
    """Positions that count real tokens only: contiguous over a row's unmasked columns, 0 on left pads."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a separate prefill


def _common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest prefix all ``prompts`` share, leaving each at least one token."""
    limit = min(len(p) for p in prompts) - 1
    common = 0
    while common < limit and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common


def shared_prefix_groups(
    prompts: list[list[int]], min_shared: int, labels: list[Any] | None = None
) -> list[tuple[int, list[int]]]:
    """Group prompts that share a prefix of at least ``min_shared`` tokens; each group's prefix is prefilled once.

    With ``labels`` (e.g. the task each prompt belongs to: GRPO group members share their prompt's
    first part, in MemAgent the problem and the chunk) prompts with the same label form a group.
    Without them, consecutive prompts join a group while they keep at least half of its prefix, so
    a chat template's common header alone does not merge two groups. A prefix always leaves at
    least one token of every member's prompt, so each member still has an input to generate from.

    Returns:
        ``(prefix_length, rows)`` per group; a prompt that shares too little is a group of its own.
    """
    candidates: list[list[int]] = []
    if labels is not None:
        by_label: dict[Any, list[int]] = {}
        for row, label in enumerate(labels):
            by_label.setdefault(label, []).append(row)
        candidates = list(by_label.values())
    else:
        for row, prompt in enumerate(prompts):
            if candidates:
                rows = candidates[-1]
                current = _common_prefix([prompts[r] for r in rows])
                joined = _common_prefix([prompts[r] for r in rows] + [prompt])
                if joined >= min_shared and 2 * joined >= current:
                    rows.append(row)
                    continue
            candidates.append([row])
    groups: list[tuple[int, list[int]]] = []
    for rows in candidates:
        length = _common_prefix([prompts[r] for r in rows])
        if len(rows) > 1 and length >= max(min_shared, 1):
            groups.append((length, rows))
        else:
            groups.extend((len(prompts[r]) - 1, [r]) for r in rows)
    return groups


@dataclass
class SharedPrefixLayout:
    """Each group's prefix once and each row's rest of prompt, both left-padded.

    A row reads ``[pad prefix][pad rest]``: pads inside it are masked out, and positions derived
    from its mask (:func:`position_ids`) stay contiguous over real tokens.
    """

    prefix_ids: Tensor  # [G, P] one prefix per group
    prefix_mask: Tensor  # [G, P]
    rest_ids: Tensor  # [B, S] each row's prompt after its group's prefix
    rest_mask: Tensor  # [B, S]
    group_of_row: Tensor  # [B] the group each row belongs to

    @property
    def row_ids(self) -> Tensor:
        """Whole prompts [B, P + S]: the row's group prefix, then its rest."""
        return torch.cat([self.prefix_ids[self.group_of_row], self.rest_ids], dim=1)

    @property
    def row_mask(self) -> Tensor:
        """Attention mask [B, P + S] of :attr:`row_ids`."""
        return torch.cat([self.prefix_mask[self.group_of_row], self.rest_mask], dim=1)


def split_shared_prefixes(
    prompts: list[list[int]], groups: list[tuple[int, list[int]]], pad_id: int, device: torch.device | str
) -> SharedPrefixLayout:
    """Cut every prompt after its group's prefix (``groups`` from :func:`shared_prefix_groups`)."""
    group_of_row = [0] * len(prompts)
    for g, (_, rows) in enumerate(groups):
        for row in rows:
            group_of_row[row] = g
    prefix_ids, prefix_mask = left_pad([prompts[rows[0]][:length] for length, rows in groups], pad_id, device)
    rests = [prompt[groups[g][0] :] for prompt, g in zip(prompts, group_of_row)]
    rest_ids, rest_mask = left_pad(rests, pad_id, device)
    index = torch.tensor(group_of_row, device=device)
    return SharedPrefixLayout(prefix_ids, prefix_mask, rest_ids, rest_mask, index)


def prefill_shared_prefixes(model: Any, layout: SharedPrefixLayout, **kwargs: Any) -> Any:
    """Run ``model`` over each group's prefix once; return the KV cache with one copy per row.

    Exact: the members' forward that continues from this cache sees the same keys and values as
    a forward over their whole prompt. The copy is a differentiable index, so the members'
    gradients flow back into the one prefix computation.

    Args:
        model: a causal LM or its decoder.
        layout: from :func:`split_shared_prefixes`.
        **kwargs: passed to the forward (e.g. ``cache=DynamicCache()``, ``logits_to_keep=1``).

    Returns:
        The cache (``kwargs["cache"]`` when given, else the forward's output cache) over the
        ``P`` prefix columns, ``[G, ...]`` reordered to ``[B, ...]``.
    """
    out = model(
        input_ids=layout.prefix_ids,
        attention_mask=layout.prefix_mask,
        position_ids=position_ids(layout.prefix_mask),
        use_cache=True,
        **kwargs,
    )
    cache = kwargs.get("cache")
    if cache is None:  # transformers 5 names the output's cache `cache` (`past_key_values` warns, deprecated)
        cache = out["cache"] if "cache" in out else out.past_key_values
    cache.reorder_cache(layout.group_of_row)  # [G, ...] -> [B, ...]
    return cache


class ReplayableLayer(DynamicLayer):
    """A KV-cache layer that answers a checkpointed decoder layer's replay in backward as it answered the forward.

    The update writes the shared prefixes once (:func:`prefill_shared_prefixes`), then the members'
    forward reads them. With gradient checkpointing each decoder layer runs again in backward and
    calls ``update`` again; a plain cache would append a second time. Here an update with the rows
    the cache holds (the members, after the prefixes were copied to them) returns the stored states
    followed by the new ones without storing anything, and any other update (the prefix pass and its
    replay) stores its states if nothing is stored yet and returns them unchanged.
    """

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states  # the prefix pass: its states are the cache
            return key_states, value_states
        if key_states.shape[0] != self.keys.shape[0]:  # the prefix pass replayed ([G] rows, the cache holds [B])
            return key_states, value_states
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def replayable_cache() -> DynamicCache:
    """An empty cache of :class:`ReplayableLayer` s, for a prefix-shared forward that may be checkpointed."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = ReplayableLayer
    return cache


@contextmanager
def checkpoint_with_cache(model: Any) -> Iterator[None]:
    """Let ``model``'s gradient-checkpointed layers keep the cache they are given (a :func:`replayable_cache`).

    transformers drops the cache of a checkpointed layer (a replay would write it twice) unless the
    layer says ``_can_checkpoint_with_cache``; the replayable cache makes that safe.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # the class's value again
