"""A rollout's KV cache with room reserved ahead: a decode step writes one column instead of copying the cache.

``transformers``' ``DynamicCache`` appends a step's keys and values by concatenation: every decode
step copies each layer's whole cache (``torch.cat``), so a rollout of ``S`` new tokens after a prompt
of ``P`` copies ``O(S·(P + S))`` cache columns per layer. On a CPU decode step of SmolLM2-135M (batch
8, 64-token prompt, fp32) those copies took 5.7 ms of 50 ms (``torch.profiler``, 60 ``aten::cat`` per
step), and they grow with the context: a MemAgent turn decodes after several hundred tokens.

:class:`ReservedLayer` keeps the first update's states as they are (a prompt's prefill, or the
shared prefixes before :func:`~lightning_memrl.rollout.prefix.prefill_shared_prefixes` copies them to
every row), and at the next update moves them into a buffer with ``room`` more columns, into which
every later update writes in place; ``keys``/``values`` are views of the filled columns. The values
are those the concatenating cache holds, so attention computes the same numbers. Whatever replaces
the held tensors from outside (``reorder_cache``, ``batch_select_indices``, ``crop``) is moved into a
new buffer at the next update. The cache holds ``room`` columns more than it has filled until the
rollout ends: at most what a rollout that runs to ``max_new_tokens`` holds anyway.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into reserved room instead of concatenating.

    Args:
        room: columns reserved beyond those filled when the buffer is made (the tokens still to come,
            e.g. ``max_new_tokens``); more updates than that move the cache into a larger buffer.
    """

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self._buffers: tuple[Tensor, Tensor] | None = None  # [B, H_kv, capacity, D] each
        self._views: tuple[Tensor, Tensor] | None = None  # the keys/values last handed out (views of the buffers)

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states  # the prefill: held as computed, no copy
            self._buffers = self._views = None
            return self.keys, self.values
        filled, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if not self._writable(end):
            self._move_to_buffers(filled, end)
        assert self._buffers is not None
        keys_buffer, values_buffer = self._buffers
        keys_buffer[:, :, filled:end].copy_(key_states)
        values_buffer[:, :, filled:end].copy_(value_states)
        self.keys, self.values = keys_buffer[:, :, :end], values_buffer[:, :, :end]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def _writable(self, end: int) -> bool:
        """Whether the held states are the buffers' own views and the buffers have room up to ``end``."""
        if self._buffers is None or self._views is None:
            return False
        held = self._views[0] is self.keys and self._views[1] is self.values
        return held and self._buffers[0].shape[-2] >= end

    def _move_to_buffers(self, filled: int, end: int) -> None:
        """New buffers with room for ``end`` columns and ``room`` more; the held columns copied in."""
        assert self.keys is not None and self.values is not None
        capacity = end + self.room
        buffers = []
        for held in (self.keys, self.values):
            batch, heads, _, dim = held.shape
            buffer = torch.empty(batch, heads, capacity, dim, dtype=held.dtype, device=held.device)
            buffer[:, :, :filled].copy_(held)
            buffers.append(buffer)
        self._buffers = (buffers[0], buffers[1])

    def reset(self) -> None:
        """Drop the held states and the buffers."""
        self._buffers = self._views = None
        super().reset()


def reserved_cache(room: int) -> DynamicCache:
    """An empty cache of :class:`ReservedLayer` s, each reserving ``room`` columns once it holds a prompt."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: ReservedLayer(room)
    return cache
