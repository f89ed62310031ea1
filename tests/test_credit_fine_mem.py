"""Fine-Mem's step reward and evidence-anchored credit (lightning_memrl.credit.fine_mem) on hand-built batches."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine
from test_memory_r1 import reply as memory_r1_reply
from test_rmm import reply as rmm_reply

from lightning_memrl.credit.fine_mem import FineMemCredit, fine_mem_terms, used_entry_ids
from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.errors import ConfigError
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=16)
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=16)


class _Log:
    def __init__(self) -> None:
        self.calls: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.calls[name] = value


def _turn(kind: str, length: int, wrote: dict[str, str] | None = None) -> Turn:
    generation = Generation(list(range(1, length + 1)), torch.zeros(length), False)
    return Turn(kind, [0], generation, info={"wrote_entries": wrote} if wrote is not None else {})


def _memagent_batch() -> RolloutBatch:
    # a group of two on one task (gold "Paris"): chunk 0 holds the answer, chunk 1 does not
    def member(memories: list[str]) -> Trajectory:
        return Trajectory(
            task=Task(question="q", context=[], answers=["Paris"]),
            turns=[_turn(MEMORY_TURN, 2), _turn(MEMORY_TURN, 2), _turn(ANSWER_TURN, 2)],
            chunks=["Paris is big", "filler"],
            memories=memories,
        )

    batch = RolloutBatch.from_trajectories([member(["Paris", "Paris"]), member(["none", "none"])], 2, pad_id=0)
    batch.rewards = torch.tensor([1.0, 0.0])
    batch.advantages = torch.tensor([0.5, 0.5, 0.5, -0.5, -0.5, -0.5]).unsqueeze(-1).expand(6, 2).clone()
    return batch


def test_memagent_step_and_evidence_rewards_by_hand() -> None:
    batch, module = _memagent_batch(), _Log()
    callback = FineMemCredit(weight=0.5)
    callback.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # s (memory holds Paris): t0 [1, 1], t1 [0, 0]; evidence = chunk 0 only, N = R / 1 on it: t0 [1, 0], t1 [0, 0]
    # r = s + N: t0 [2, 1], t1 [0, 0]; group mean 3/4; Â: t0 [1.25, 0.25], t1 [-0.75, -0.75]
    # memory tokens 0.5 * A + 0.5 * Â: t0 [0.875, 0.375], t1 [-0.625, -0.625]; answers keep A
    expected = [0.875, 0.375, 0.5, -0.625, -0.625, -0.5]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected).unsqueeze(-1).expand(6, 2))
    # means over the 4 memory turns: s 2/4, N 1/4, evidence (chunk 0 of both members) 2/4
    assert module.calls == pytest.approx(
        {"train/fine_mem/step_reward": 0.5, "train/fine_mem/evidence_reward": 0.25, "train/fine_mem/evidence_frac": 0.5}
    )
    assert callback.state_dict() == {"evidence_turns": 2, "credited_turns": 4}
    restored = FineMemCredit()
    restored.load_state_dict(callback.state_dict())
    assert restored.state_dict() == {"evidence_turns": 2, "credited_turns": 4}


def test_bank_reward_goes_to_the_turns_that_wrote_the_used_entries() -> None:
    # three manager turns: ADD m0, ADD m1, UPDATE m0; the answer selected m0 and m9 (an entry no turn wrote)
    trajectory = Trajectory(
        task=Task(question="q", context=[], answers=["Paris"]),
        turns=[
            _turn("extract", 2),
            _turn(MEMORY_TURN, 2, {"m0": "Caroline likes Paris"}),
            _turn(MEMORY_TURN, 2, {"m1": "Bob runs"}),
            _turn(MEMORY_TURN, 2, {"m0": "Caroline loves Paris"}),
            _turn(ANSWER_TURN, 2),
        ],
        info={"shown_ids": ["m0", "m1", "m9"], "selected_ids": ["m0", "m9"]},
    )
    # |U| = 2, m0 has two writers: N = 1 * 1 / (2 * 2) on turns 0 and 2; s = [1, 0, 1]
    assert fine_mem_terms(trajectory, 1.0) == ([1.0, 0.0, 1.0], [0.25, 0.0, 0.25], [True, False, True])
    batch = RolloutBatch.from_trajectories([trajectory], 1, pad_id=0)
    batch.rewards = torch.tensor([1.0])
    batch.advantages = torch.zeros(5, 2)
    FineMemCredit(weight=1.0, evidence_weight=2.0).on_advantages(None, _Log(), batch)  # type: ignore[arg-type]
    # r = s + 2 N = [1.5, 0, 1.5], mean 1; Â = [0.5, -1, 0.5]; weight 1: memory tokens carry Â alone
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([0.0, 0.5, -1.0, 0.5, 0.0]))
    # RMM cites 0-based positions of the shown entries
    assert used_entry_ids(Trajectory(task=trajectory.task, info={"shown_ids": ["m3", "m1"], "cited": [1]})) == ["m1"]


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path))


def test_memory_r1_manager_turns_record_what_they_wrote_and_get_the_credit(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, memory_r1_reply)
    workflow = MemoryR1Workflow(stage="manager", turns_per_segment=0)
    workflow.frozen_engine = engine
    trajectories = workflow.rollout(engine, [tasks[0], tasks[0]], SAMPLED)  # gold "Miso"; the answer selects m0
    writes = [t.info.get("wrote_entries") for t in trajectories[0].turns if t.kind == MEMORY_TURN]
    assert writes == [{"m0": "Ana has a cat named Miso"}, None, {"m1": "Ben moved to Lisbon."}]  # NOOP writes nothing
    batch = RolloutBatch.from_trajectories(trajectories, group_size=2, pad_id=engine.pad_id)
    batch.rewards = torch.tensor([1.0, 0.0])
    batch.advantages = torch.tensor([0.5] * 3 + [-0.5] * 3).unsqueeze(-1).expand_as(batch.response_mask).clone()
    FineMemCredit(weight=0.5).on_advantages(None, _Log(), batch)  # type: ignore[arg-type]
    # s = [1, 0, 0] for both; N = [R, 0, 0]; r: [2, 0, 0] and [1, 0, 0]; group mean 3/6 = 0.5
    # Â: [1.5, -0.5, -0.5] and [0.5, -0.5, -0.5]; 0.5 * A + 0.5 * Â on the first token of each row
    torch.testing.assert_close(batch.advantages[:, 0], torch.tensor([1.0, 0.0, 0.0, 0.0, -0.5, -0.5]))


def test_rmm_merge_turns_record_the_entry_they_wrote(tasks, tiny_tokenizer):
    workflow = RMMWorkflow(merge_top_k=3)
    workflow.frozen_engine = engine = ScriptedEngine(tiny_tokenizer, rmm_reply)
    ((bank, turns),) = workflow.build_banks(engine, [tasks[0].meta["conversation"]], GREEDY, False)
    writes = [t.info["wrote_entries"] for t in turns if t.kind == MEMORY_TURN]
    assert {"m0": "Ana's cat Miso broke a vase"} in writes  # the MERGE into m0
    assert all(bank.get(i).id == i for w in writes for i in w)


@pytest.mark.parametrize(
    "workflow",
    [MemoryR1Workflow(stage="answerer"), RMMWorkflow(), Workflow()],
    ids=["memory_r1_answerer", "rmm", "custom"],
)
def test_refuses_workflows_whose_memory_writes_it_cannot_credit(workflow: Workflow) -> None:
    message = f"FineMemCredit cannot serve {type(workflow).__name__}"
    with pytest.raises(ConfigError, match=message):
        FineMemCredit().setup(None, SimpleNamespace(workflow=workflow), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize("workflow", [MemAgentWorkflow(), MemoryR1Workflow(stage="manager")], ids=["memagent", "r1"])
def test_serves_memagent_and_a_trained_memory_manager(workflow: Workflow) -> None:
    FineMemCredit().setup(None, SimpleNamespace(workflow=workflow), "fit")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"weight": 2.0}, "weight must be in"), ({"step_weight": -1.0}, "must be >= 0")]
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FineMemCredit(**kwargs)
