"""The MemAgent workflow on the tiny model: turns, memory budget, flattening."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl.memory.text import TextMemoryStore
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, RolloutBatch, Task
from lightning_memrl.workflows.base import split_context
from lightning_memrl.workflows.memagent import MemAgentWorkflow


def _tasks():
    return [
        Task("What is the secret code of Alice?", ["Filler.", "The secret code of Alice is 1234.", "More."], ["1234"]),
        Task("What is the secret code of Bruno?", ["The secret code of Bruno is 5678."], ["5678"]),
    ]


def test_turns_memory_budget_and_flattening(tiny_model, tiny_tokenizer):
    workflow = MemAgentWorkflow(max_memory_tokens=5, max_chunks=2)
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    tasks = [t for t in _tasks() for _ in range(3)]  # group of 3
    torch.manual_seed(0)
    trajectories = workflow.rollout(engine, tasks, GenerationSettings(temperature=1.0, max_new_tokens=7))
    # task 0 has 3 chunks but max_chunks=2: 2 memory turns + 1 answer; task 1: 1 + 1
    assert [len(t.turns) for t in trajectories] == [3, 3, 3, 2, 2, 2]
    assert [t.chunks_dropped for t in trajectories] == [1, 1, 1, 0, 0, 0]
    for traj in trajectories:
        assert [turn.kind for turn in traj.turns] == [MEMORY_TURN] * (len(traj.turns) - 1) + [ANSWER_TURN]
        assert all(len(turn.generation.token_ids) <= 5 for turn in traj.turns[:-1])  # memory budget
        assert len(traj.turns[-1].generation.token_ids) <= 7
        assert len(traj.memories) == len(traj.turns) - 1
    # the memory written at turn k is what the prompt of turn k+1 shows
    first = trajectories[0]
    second_prompt = tiny_tokenizer.decode(first.turns[1].prompt_ids)
    assert (first.memories[0] or workflow.memory.empty_text) in second_prompt
    assert "The secret code of Alice is 1234." in second_prompt  # chunk 2
    assert workflow.memory.empty_text in tiny_tokenizer.decode(first.turns[0].prompt_ids)

    batch = RolloutBatch.from_trajectories(trajectories, 3, engine.pad_id)
    assert batch.response_ids.shape[0] == 15 and batch.turn_to_trajectory.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [
        3,
        3,
        4,
        4,
        5,
        5,
    ]
    assert batch.memory_turns.tolist()[:3] == [True, True, False]
    row = 0
    for traj in trajectories:  # token-in/token-out: the batch holds exactly the generated ids
        for turn in traj.turns:
            n = len(turn.generation.token_ids)
            assert batch.response_ids[row, :n].tolist() == turn.generation.token_ids
            assert int(batch.response_mask[row].sum()) == n
            row += 1


def test_long_text_is_cut_into_chunks(tiny_tokenizer):
    workflow = MemAgentWorkflow(chunk_tokens=8)
    text = " ".join(["The bridge over the canal was painted blue."] * 4)
    chunks = split_context(text, tiny_tokenizer, workflow.chunk_tokens)
    n_tokens = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(chunks) == -(-n_tokens // 8)
    assert "".join(chunks) == text


def test_template_placeholders_are_checked():
    with pytest.raises(ValueError, match="memory_template lacks the placeholders"):
        MemAgentWorkflow(memory_template="{problem} only")


def test_memory_store_budget_and_state(tiny_tokenizer):
    store = TextMemoryStore(max_memory_tokens=3)
    store.reset(2)
    assert store.read(0) == store.empty_text
    ids = tiny_tokenizer("one two three four five", add_special_tokens=False)["input_ids"]
    text = store.write(0, ids, tiny_tokenizer)
    assert store.token_counts[0] == 3 and store.truncated_writes == 1
    assert text == tiny_tokenizer.decode(ids[:3]).strip()
    restored = TextMemoryStore(max_memory_tokens=1)
    restored.load_state_dict(store.state_dict())
    assert restored.state_dict() == store.state_dict()
    with pytest.raises(ValueError):
        TextMemoryStore(0)
