"""The reserved KV cache: the states a concatenating cache holds, written in place, and the same rollouts."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.kv_cache import ReservedLayer, reserved_cache
from lightning_memrl.settings import GenerationSettings


def _states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=generator), torch.randn(batch, 2, length, 4, generator=generator)


def test_updates_hold_what_concatenation_holds_in_one_buffer() -> None:
    reserved, plain = ReservedLayer(room=3), DynamicLayer()
    pointers = set()
    for step, length in enumerate((5, 1, 1, 1)):  # a prefill, then decode steps within the room
        keys, values = _states(2, length, seed=step)
        got, want = reserved.update(keys, values), plain.update(keys, values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step:
            pointers.add(got[0].data_ptr())
    assert len(pointers) == 1  # every decode step wrote into the same buffer
    assert reserved.get_seq_length() == 8 and reserved._buffers[0].shape[-2] == 5 + 1 + 3


def test_past_the_room_and_after_a_reorder_it_moves_to_a_new_buffer() -> None:
    reserved, plain = ReservedLayer(room=1), DynamicLayer()
    for step, length in enumerate((3, 1, 1, 1)):  # the third decode step is past the room
        keys, values = _states(2, length, seed=step)
        got, want = reserved.update(keys, values), plain.update(keys, values)
    assert torch.equal(got[0], want[0]) and reserved._buffers[0].shape[-2] == 6 + 1
    order = torch.tensor([1, 1, 0])
    reserved.reorder_cache(order)  # as prefill_shared_prefixes copies a group's prefix to its rows
    plain.reorder_cache(order)
    keys, values = _states(3, 2, seed=9)
    got, want = reserved.update(keys, values), plain.update(keys, values)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape == (3, 2, 8, 4) and reserved._buffers[0].shape == (3, 2, 8 + 1, 4)


def test_reserved_cache_makes_reserved_layers() -> None:
    cache = reserved_cache(room=4)
    cache.update(*_states(1, 2, seed=0), layer_idx=1)
    assert [type(layer) for layer in cache.layers] == [ReservedLayer, ReservedLayer]
    assert cache.layers[1].room == 4 and cache.get_seq_length(1) == 2


@pytest.mark.parametrize("labels", [None, [0, 1, 2, 3]], ids=["shared_prefix", "unshared"])
def test_rollouts_are_the_same_with_and_without_the_reserve(tiny_tokenizer, labels) -> None:
    model = build_tiny_model(tiny_tokenizer, seed=0).eval()
    prefix = list(range(5, 40))
    prompts = [prefix + [50 + row] * (row + 1) for row in range(4)]
    settings = GenerationSettings(temperature=1.0, max_new_tokens=10)
    runs = []
    for reserve in (False, True):
        torch.manual_seed(5)
        engine = RolloutEngine(model, tiny_tokenizer, reserve_kv_cache=reserve)
        runs.append(engine.generate(prompts, settings, prefix_labels=labels))
    for off, on in zip(*runs):
        assert on.token_ids == off.token_ids and torch.equal(on.logprobs, off.logprobs)
