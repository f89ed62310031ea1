"""Frozen agents generate with a fixed model: Memory-R1's answer agent, frozen extractor facts, RMM reflection."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import quiet_trainer
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine

from lightning_memrl import GenerationSettings, GRPOSettings, MemRLDataModule, MemRLModule, OptimizerSettings
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.memory.bank import MemoryBank
from lightning_memrl.models import LoraSettings
from lightning_memrl.rewards import RewardFunction
from lightning_memrl.types import Trajectory
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=12)
SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=12)


class NoisyReward(RewardFunction):
    """Seeded noise: every group has non-zero advantages, so each step moves the policy."""

    default_name = "noise"

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)

    def score_answer(self, completion: str, answers: list[str]) -> float:
        return self.rng.random()


def _answer_probe(module: MemRLModule, task) -> tuple[list[int], float]:
    """The answer agent's greedy answer to a fixed prompt (fixed bank, fixed question)."""
    module.policy.eval()
    bank = MemoryBank("bm25")
    bank.add("Ana has a cat named Miso", "session_1", "3 May 2023", ["D1:1"])
    trajectory = Trajectory(task=task)
    module.workflow.answer(module.engine, [trajectory], [bank], GREEDY)
    generation = trajectory.turns[-1].generation
    return generation.token_ids, float(generation.logprobs.sum())


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)], ids=["full", "lora"])
def test_memory_r1_answer_agent_stays_frozen_while_the_manager_trains(tmp_path, lora):
    path = write_locomo(tmp_path / "data")
    workflow = MemoryR1Workflow(
        stage="manager",
        train_extractor=True,
        turns_per_segment=0,
        max_facts=2,
        extract_max_tokens=8,
        manage_max_tokens=8,
    )
    module = MemRLModule(
        lora=lora,
        workflow=workflow,
        rewards=[NoisyReward()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2),
        optimizer=OptimizerSettings(lr=5e-2),
    )
    data = MemRLDataModule(locomo_path=str(path), locomo=LoCoMoSettings(max_sessions=1), batch_size=1)
    module.configure_model()
    task = load_locomo(path)[0]
    before = _answer_probe(module, task)
    weights = {k: v.clone() for k, v in module.policy.state_dict().items()}
    quiet_trainer(tmp_path, steps=3).fit(module, data)
    moved = [k for k, v in module.policy.state_dict().items() if not torch.equal(v, weights[k])]
    assert moved  # the manager (and extractor) trained
    after = _answer_probe(module, task)
    assert after[0] == before[0]  # same greedy answer tokens
    assert after[1] == pytest.approx(before[1], abs=1e-4)  # same log-prob sum
    assert "frozen" in workflow.frozen_engine.description or "disabled" in workflow.frozen_engine.description


def _engines(tiny_tokenizer, reply):
    return ScriptedEngine(tiny_tokenizer, reply), ScriptedEngine(tiny_tokenizer, reply)


def _reply(prompt: str) -> str:
    if "List at most" in prompt:
        return "[D1:1] Ana adopted a cat named Miso." if "session_1 (" in prompt else "none"
    if "You manage a memory bank" in prompt or "Existing memories similar" in prompt:
        return '{"op": "ADD"}'
    return "Memories: m0\nAnswer: \\boxed{Miso}"


def _kinds(engine) -> set[str]:
    names = {"List at most": "extract", "You manage": "manage", "Existing memories": "merge", "Question:": "answer"}
    return {kind for prompt, _ in engine.calls for key, kind in names.items() if key in prompt}


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path), LoCoMoSettings(max_sessions=1))


@pytest.mark.parametrize(
    ("stage", "policy_kinds", "frozen_kinds"),
    [("manager", {"manage"}, {"extract", "answer"}), ("answerer", {"answer"}, {"extract", "manage"})],
)
def test_memory_r1_frozen_roles_use_the_frozen_engine(tasks, tiny_tokenizer, stage, policy_kinds, frozen_kinds):
    policy, frozen = _engines(tiny_tokenizer, _reply)
    workflow = MemoryR1Workflow(stage=stage, turns_per_segment=0)
    with pytest.raises(RuntimeError, match="no frozen_engine"):
        workflow.rollout(policy, tasks[:1], SAMPLED)
    workflow.frozen_engine = frozen
    for settings in (SAMPLED, GREEDY):  # training and validation alike
        workflow.rollout(policy, tasks[:1], settings)
    assert _kinds(policy) == policy_kinds
    assert _kinds(frozen) == frozen_kinds


def test_trained_extractor_facts_are_rebuilt_after_training(tasks, tiny_tokenizer):
    policy, frozen = _engines(tiny_tokenizer, _reply)
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0, train_extractor=True)
    workflow.frozen_engine = frozen

    def extractions() -> int:
        return sum("List at most" in p for p, _ in policy.calls)

    workflow.rollout(policy, tasks[:1], GREEDY)  # validation: the extractor's facts are cached
    assert extractions() == 1 and list(workflow._facts_cache) == ["conv-test"]
    workflow.rollout(policy, tasks[:1], GREEDY)
    assert extractions() == 1  # same weights: cached
    workflow.rollout(policy, tasks[:1], SAMPLED)  # training rollout: an optimizer step follows
    assert workflow._facts_cache == {}
    trained = extractions()
    workflow.rollout(policy, tasks[:1], GREEDY)
    assert extractions() == trained + 1  # rebuilt by the trained extractor
    assert not any("List at most" in p for p, _ in frozen.calls)


def test_frozen_extractor_facts_are_built_once_by_the_frozen_model(tasks, tiny_tokenizer):
    policy, frozen = _engines(tiny_tokenizer, _reply)
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0)
    workflow.frozen_engine = frozen
    for settings in (GREEDY, SAMPLED, GREEDY, SAMPLED):
        workflow.rollout(policy, tasks[:1], settings)
    assert sum("List at most" in p for p, _ in frozen.calls) == 1
    assert not any("List at most" in p for p, _ in policy.calls)


def test_rmm_reflection_uses_the_frozen_engine(tasks, tiny_tokenizer):
    policy, frozen = _engines(tiny_tokenizer, _reply)
    workflow = RMMWorkflow(top_k=3, top_m=1)
    assert workflow.needs_frozen_model() and not RMMWorkflow(train_generator=False).needs_frozen_model()
    workflow.frozen_engine = frozen
    workflow.rollout(policy, tasks[:1], SAMPLED)
    assert _kinds(frozen) == {"extract"}  # the reflection prompt ("List at most ... topics")
    assert _kinds(policy) == {"answer"}
    lone = RMMWorkflow(top_k=3, top_m=1, train_generator=False)  # nothing trains: the policy is the fixed model
    lone.rollout(policy, tasks[:1], SAMPLED)


def test_frozen_engine_is_not_pickled_with_the_workflow(tiny_tokenizer):
    import pickle

    workflow = MemoryR1Workflow()
    workflow.frozen_engine = ScriptedEngine(tiny_tokenizer, _reply)
    restored = pickle.loads(pickle.dumps(workflow))
    assert restored.frozen_engine is None and workflow.frozen_engine is not None
