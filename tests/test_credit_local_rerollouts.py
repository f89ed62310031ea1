"""Local re-rollouts (lightning_memrl.credit.local_rerollouts): re-rolled memory turns, their rows and advantages."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scripted_engine import ScriptedEngine

from lightning_memrl.credit.local_rerollouts import LocalRerollouts
from lightning_memrl.errors import ConfigError
from lightning_memrl.rewards import ExactMatch
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow

SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=16)


def _script(memory_replies: list[str]) -> Any:
    """Memory turns say the next of ``memory_replies``; the answer turn says \\boxed{x}."""
    queue = list(memory_replies)
    return lambda prompt: queue.pop(0) if "notes so far" in prompt else "\\boxed{x}"


class _Module(SimpleNamespace):
    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged[name] = value


def _module(tiny_model, engine: ScriptedEngine, workflow: MemAgentWorkflow, rewards=()) -> _Module:
    return _Module(
        policy=tiny_model,
        engine=engine,
        workflow=workflow,
        generation=SAMPLED,
        reward_functions=list(rewards),
        logged={},
    )


def _answers_from_notes(memory_replies: list[str]) -> Any:
    """Memory turns say the next of ``memory_replies``; the answer is Alice Smith when the notes hold it, else Bob."""
    queue = list(memory_replies)

    def reply(prompt: str) -> str:
        if "notes so far" in prompt:
            return queue.pop(0)
        return "\\boxed{Alice Smith}" if "Alice Smith" in prompt else "\\boxed{Bob}"

    return reply


def _turn(kind: str, length: int) -> Turn:
    return Turn(kind, [5, 6], Generation(list(range(1, length + 1)), torch.full((length,), -0.5), length > 3))


def test_append_turns_pads_to_a_common_width_and_ties_rows_to_trajectories() -> None:
    task = Task(question="q", context=[], answers=["a"])
    trajectories = [Trajectory(task, [_turn(MEMORY_TURN, 2), _turn(ANSWER_TURN, 1)]), Trajectory(task, [])]
    batch = RolloutBatch.from_trajectories(trajectories, 2, pad_id=0)
    batch.advantages = torch.ones(2, 2)
    rows = batch.append_turns([_turn(MEMORY_TURN, 4)], [1], pad_id=0)
    assert rows == [2]
    # width grows from 2 to 4; old rows are right-padded with pad id 0 / mask 0 / log-prob 0 / advantage 0
    assert batch.response_ids.tolist() == [[1, 2, 0, 0], [1, 0, 0, 0], [1, 2, 3, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.rollout_logprobs[2].tolist() == [-0.5] * 4 and batch.rollout_logprobs[0, 2:].tolist() == [0, 0]
    assert batch.advantages.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert batch.turn_to_trajectory.tolist() == [0, 0, 1] and batch.turn_to_trajectory.dtype == torch.long
    assert batch.memory_turns.tolist() == [True, False, True]
    assert batch.truncated.tolist() == [False, False, True]
    assert batch.turn_rewards.tolist() == [0.0, 0.0, 0.0] and batch.prompt_ids[2] == [5, 6]
    with pytest.raises(ValueError, match="not in"):
        batch.append_turns([_turn(MEMORY_TURN, 1)], [2], pad_id=0)


def test_reroll_rebuilds_the_recorded_prompt_from_the_pre_write_memory(tiny_tokenizer) -> None:
    workflow = MemAgentWorkflow(max_memory_tokens=32)
    engine = ScriptedEngine(tiny_tokenizer, _script(["first notes", "second notes"]))
    task = Task(question="Who won?", context=["Bob ran.", "Alice Smith won."], answers=["Alice Smith"], id="t0")
    (trajectory,) = workflow.rollout(engine, [task], SAMPLED)
    engine.reply = _script(["Alice", "Bob"])
    turns = workflow.reroll_memory_turn(engine, trajectory, 1, 2, SAMPLED)
    assert [t.prompt_ids for t in turns] == [trajectory.turns[1].prompt_ids] * 2  # read m_0 = "first notes", chunk 1
    assert "first notes" in engine.calls[-1][0] and "Alice Smith won." in engine.calls[-1][0]
    assert [t.text for t in turns] == ["Alice", "Bob"] and all(t.kind == MEMORY_TURN for t in turns)
    assert trajectory.memories == ["first notes", "second notes"]  # the trajectory is left as it was
    workflow.memory_template = "other {problem} {chunk} {memory}"
    with pytest.raises(ValueError, match="rebuilt prompt of memory turn 1 .*'t0'"):
        workflow.reroll_memory_turn(engine, trajectory, 1, 2, SAMPLED)


def test_local_group_rows_and_advantages_by_hand(tiny_model, tiny_tokenizer) -> None:
    workflow = MemAgentWorkflow(max_memory_tokens=32)
    engine = ScriptedEngine(tiny_tokenizer, _script(["nothing"]))
    task = Task(question="Who won?", context=["Alice Smith won."], answers=["Alice Smith"])
    batch = RolloutBatch.from_trajectories(workflow.rollout(engine, [task], SAMPLED), 1, engine.pad_id)
    engine.reply = _script(["Alice", "Alice Smith", "Bob"])
    module = _module(tiny_model, engine, workflow)
    callback = LocalRerollouts(probability=1.0, num_rerollouts=3, local_coef=2.0, local_reward="memory_recall")
    callback.on_rewards(None, module, batch)  # type: ignore[arg-type]
    # rows: 0 memory turn, 1 answer, 2..4 the re-rolls of memory turn 0, tied to trajectory 0, no turn reward
    assert batch.turn_to_trajectory.tolist() == [0] * 5 and batch.memory_turns.tolist() == [1, 0, 1, 1, 1]
    assert batch.turn_rewards.tolist() == [0.0] * 5 and batch.prompt_ids[2:] == [batch.prompt_ids[0]] * 3
    ids = tiny_tokenizer("Alice Smith", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert batch.response_ids[3, : len(ids)].tolist() == ids and int(batch.response_mask[3].sum()) == len(ids)
    # local rewards = answer-word recall of each memory: original "nothing" 0, re-rolls 0.5, 1.0, 0
    # re-roll mean (0.5 + 1 + 0) / 3 = 0.5
    logged = {
        "train/local_rerollouts/rerolled_turns": 3.0,
        "train/local_rerollouts/nonfinite_rewards": 0.0,
        "train/local_rerollouts/local_reward_mean": 0.5,
    }
    assert module.logged == logged
    batch.advantages = 0.5 * batch.response_mask.float()  # the global advantage 0.5 on every token
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # local mean (0 + 0.5 + 1 + 0) / 4 = 0.375 -> local advantages -0.375, 0.125, 0.625, -0.375; local_coef 2:
    # original 0.5 + 2 * -0.375 = -0.25; re-rolls (no global part) 0.25, 1.25, -0.75; the answer keeps 0.5
    expected = torch.tensor([-0.25, 0.5, 0.25, 1.25, -0.75]).unsqueeze(-1) * batch.response_mask
    torch.testing.assert_close(batch.advantages, expected)
    assert callback.rerolled_turns == 3


def test_picks_follow_the_checkpointed_generator(tiny_tokenizer) -> None:
    task = Task(question="q", context=[], answers=["a"])
    member = Trajectory(task, [_turn(MEMORY_TURN, 1), _turn(MEMORY_TURN, 1), _turn(ANSWER_TURN, 1)], memories=["", ""])
    batch = RolloutBatch.from_trajectories([member] * 8, 8, pad_id=0)
    callback = LocalRerollouts(probability=0.5, seed=3)
    callback.pick(batch)
    state = callback.state_dict()
    after = callback.pick(batch)
    restored = LocalRerollouts(probability=0.5, seed=99)
    restored.load_state_dict(state)
    assert restored.pick(batch) == after and 0 < len(after) < 8  # some picked, some not
    assert all(row == 3 * t + k for t, k, row in after)  # memory turn k of trajectory t is row 3t + k
    assert LocalRerollouts(probability=0.0).pick(batch) == []


def test_refuses_a_workflow_without_reroll_at_setup() -> None:
    message = "LocalRerollouts cannot serve MemoryR1Workflow: .* no reroll_memory_turn"
    with pytest.raises(ConfigError, match=message):
        LocalRerollouts().setup(None, SimpleNamespace(workflow=MemoryR1Workflow()), "fit")  # type: ignore[arg-type]
    LocalRerollouts().setup(None, SimpleNamespace(workflow=MemAgentWorkflow()), "fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_rerollouts must be >= 1"):
        LocalRerollouts(num_rerollouts=0)


def test_continue_rerolls_reads_the_remaining_chunks_from_the_rerolled_memory(tiny_tokenizer) -> None:
    workflow = MemAgentWorkflow(max_memory_tokens=32)
    engine = ScriptedEngine(tiny_tokenizer, _answers_from_notes(["nothing", "still nothing"]))
    task = Task(question="Who won?", context=["Alice Smith won.", "Bob ran."], answers=["Alice Smith"])
    (trajectory,) = workflow.rollout(engine, [task], SAMPLED)
    store_before = workflow.memory.state_dict()
    engine.reply = _answers_from_notes(["Alice Smith", "kept: Alice Smith", "Bob"])
    turns = workflow.reroll_memory_turn(engine, trajectory, 0, 1, SAMPLED)
    (continued,) = workflow.continue_rerolls(engine, trajectory, 0, turns, SAMPLED)
    assert continued.memories == ["Alice Smith", "kept: Alice Smith"]  # turn 1 read chunk 1 after the re-roll
    assert continued.turns[0] is turns[0] and [t.kind for t in continued.turns] == [
        MEMORY_TURN,
        MEMORY_TURN,
        ANSWER_TURN,
    ]
    assert "Alice Smith" in tiny_tokenizer.decode(continued.turns[1].prompt_ids)
    assert "Bob ran." in tiny_tokenizer.decode(continued.turns[1].prompt_ids)
    assert continued.final_text == "\\boxed{Alice Smith}"
    assert trajectory.memories == ["nothing", "still nothing"] and len(trajectory.turns) == 3  # left as it was
    assert workflow.memory.state_dict() == store_before  # the workflow's store is untouched


def test_outcome_local_rewards_by_hand(tiny_model, tiny_tokenizer) -> None:
    workflow = MemAgentWorkflow(max_memory_tokens=32)
    engine = ScriptedEngine(tiny_tokenizer, _answers_from_notes(["nothing"]))
    task = Task(question="Who won?", context=["Alice Smith won."], answers=["Alice Smith"])
    batch = RolloutBatch.from_trajectories(workflow.rollout(engine, [task], SAMPLED), 1, engine.pad_id)
    engine.reply = _answers_from_notes(["Alice Smith", "Alice", "Bob"])
    module = _module(tiny_model, engine, workflow, rewards=[ExactMatch()])
    callback = LocalRerollouts(probability=1.0, num_rerollouts=3)  # local_reward: outcome (default), local_coef 1
    callback.on_rewards(None, module, batch)  # type: ignore[arg-type]
    # exact match of the answer each memory leads to: original "nothing" -> Bob 0; re-rolls 1, 0, 0
    assert module.logged["train/local_rerollouts/local_reward_mean"] == pytest.approx(1 / 3)
    batch.advantages = 0.5 * batch.response_mask.float()
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # local mean (0 + 1 + 0 + 0) / 4 = 0.25: original 0.5 - 0.25 = 0.25; re-rolls 0.75, -0.25, -0.25; answer 0.5
    expected = torch.tensor([0.25, 0.5, 0.75, -0.25, -0.25]).unsqueeze(-1) * batch.response_mask
    torch.testing.assert_close(batch.advantages, expected)


def test_unscored_local_rewards_are_left_out_and_counted(tiny_model, tiny_tokenizer) -> None:
    class OnlyAlice(ExactMatch):  # leaves answers other than Alice Smith unscored (NaN)
        def score_answer(self, completion: str, answers: list[str]) -> float | None:
            return 1.0 if "Alice Smith" in completion else None

    workflow = MemAgentWorkflow(max_memory_tokens=32)
    engine = ScriptedEngine(tiny_tokenizer, _answers_from_notes(["Alice Smith"]))
    task = Task(question="Who won?", context=["Alice Smith won."], answers=["Alice Smith"])
    batch = RolloutBatch.from_trajectories(workflow.rollout(engine, [task], SAMPLED), 1, engine.pad_id)
    engine.reply = _answers_from_notes(["Bob", "Alice Smith"])
    module = _module(tiny_model, engine, workflow, rewards=[OnlyAlice()])
    callback = LocalRerollouts(probability=1.0, num_rerollouts=2)
    callback.on_rewards(None, module, batch)  # type: ignore[arg-type]
    batch.advantages = torch.zeros_like(batch.response_mask, dtype=torch.float32)
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # rewards [1, NaN, 1]: the mean of the finite ones is 1, so every local advantage is 0 (NaN one: no term)
    assert not batch.advantages.isnan().any() and not batch.advantages.any()
    assert module.logged["train/local_rerollouts/nonfinite_rewards"] == 1.0 and callback.nonfinite_rewards == 1
    assert module.logged["train/local_rerollouts/local_reward_mean"] == 1.0


def test_refuses_dynamic_sampling_at_setup() -> None:
    module = SimpleNamespace(workflow=MemAgentWorkflow(), dynamic_sampling=object())
    with pytest.raises(ConfigError, match="LocalRerollouts cannot run with model.init_args.dynamic_sampling"):
        LocalRerollouts().setup(None, module, "fit")
