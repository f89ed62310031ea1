"""examples/custom_workflow.py: a workflow written in one file, on the tiny model and chosen from YAML
through the real CLI."""

from __future__ import annotations

import json
import sys

import torch
from test_cli import REPO, TINY, _cli, _logs, _ok

from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, RolloutBatch, Task

sys.path.insert(0, str(REPO / "examples"))
from custom_workflow import AppendNotesWorkflow  # noqa: E402


def test_notes_are_appended_one_line_per_chunk(tiny_model, tiny_tokenizer) -> None:
    workflow = AppendNotesWorkflow(note_tokens=5, max_chunks=2)
    tasks = [
        Task("Code of Alice?", ["Filler.", "The secret code of Alice is 1234.", "More."], ["1234"], id="a"),
        Task("Code of Bruno?", ["The secret code of Bruno is 5678."], ["5678"], id="b"),
    ]
    torch.manual_seed(0)
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    trajectories = workflow.rollout(engine, [t for t in tasks for _ in range(2)], GenerationSettings(max_new_tokens=7))
    assert [[turn.kind for turn in t.turns] for t in trajectories] == [[MEMORY_TURN] * 2 + [ANSWER_TURN]] * 2 + [
        [MEMORY_TURN, ANSWER_TURN]
    ] * 2
    assert [t.chunks_dropped for t in trajectories] == [1, 1, 0, 0]  # max_chunks=2 of Alice's 3
    for trajectory in trajectories:
        notes = [turn.text for turn in trajectory.turns[:-1]]
        assert all(len(turn.generation.token_ids) <= 5 for turn in trajectory.turns[:-1])  # note_tokens
        assert len(trajectory.turns[-1].generation.token_ids) <= 7
        # append-only: the memory after chunk k holds the notes of chunks 0..k, one line each
        assert trajectory.memories == ["\n".join(notes[: k + 1]) for k in range(len(notes))]
        answer_prompt = tiny_tokenizer.decode(trajectory.turns[-1].prompt_ids)
        assert all(note in answer_prompt for note in notes)
    # the second note's prompt shows chunk 2, not the first note (notes are not rewritten)
    assert "The secret code of Alice is 1234." in tiny_tokenizer.decode(trajectories[0].turns[1].prompt_ids)
    batch = RolloutBatch.from_trajectories(trajectories, 2, engine.pad_id)
    assert batch.memory_turns.tolist() == [True, True, False] * 2 + [True, False] * 2


def test_custom_workflow_chosen_from_yaml(tmp_path) -> None:
    config = str(REPO / "examples" / "custom_workflow.yaml")
    args = ("--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--trainer.num_sanity_val_steps", "0")
    _ok(_cli("fit", "--config", TINY, "--config", config, *args, cwd=tmp_path, extra_path=str(REPO / "examples")))
    ckpt = torch.load(_logs(tmp_path) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["hyper_parameters"]["workflow"]["class_path"] == "custom_workflow.AppendNotesWorkflow"
    (predictions,) = list(_logs(tmp_path).glob("**/eval_predictions_step1.jsonl"))
    rows = [json.loads(line) for line in predictions.open()]
    assert len(rows) == 4  # limit_val_batches=1 x val_batch_size 4
    for row in rows:
        memories = row["memories"]
        assert 2 <= len(memories) == row["chunks"] <= 3  # one note turn per chunk of the synthetic tasks
        for k, memory in enumerate(memories):  # append-only: k + 1 lines, each memory extends the last
            assert len(memory.split("\n")) == k + 1
            assert k == 0 or memory.startswith(memories[k - 1] + "\n")
