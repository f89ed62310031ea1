"""Dynamic sampling (DAPO): which groups are kept, how refill rounds fill the batch, the step that keeps
nothing, the refill generator in checkpoints, and the real training loop skipping empty steps."""

from __future__ import annotations

import csv
import math
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import quiet_trainer

from lightning_memrl import GenerationSettings, MemAgentWorkflow, MemRLDataModule, MemRLModule, SyntheticTaskSettings
from lightning_memrl.credit.dynamic_sampling import (
    DynamicSampling,
    EmptyStepsError,
    concat_batches,
    select_groups,
    varied_groups,
)
from lightning_memrl.errors import ConfigError
from lightning_memrl.rewards import RewardFunction
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn

NAN = float("nan")
REPO = Path(__file__).resolve().parents[1]
G = 2
TASKS = [Task("q", ["c"], ["a"], id=f"t{i}") for i in range(6)]
# DynamicSampling(seed=0) over these 6 tasks draws, 2 per round: [t2, t4], [t5, t0], [t5, t0], [t4, t2]


def trajectory(task: Task, index: int) -> Trajectory:
    """Two turns (memory, answer) whose responses are 1 + index % 3 and 2 tokens long."""
    turns = [
        Turn(MEMORY_TURN, [index], Generation([7] * (1 + index % 3), torch.zeros(1 + index % 3), False), "m"),
        Turn(ANSWER_TURN, [index, 9], Generation([8, 8], torch.full((2,), -0.5), index % 2 == 1), "a", reward=0.1),
    ]
    return Trajectory(task=task, turns=turns)


class Stub:
    """The module as dynamic sampling sees it: rollouts of scripted trajectories, rewards by task from ``scores``."""

    generation = GenerationSettings()
    engine = SimpleNamespace(pad_id=0)

    def __init__(self, scores: dict[str, list[float]]) -> None:
        self.scores, self.rolled, self.logged = scores, [], {}

    def rollout(self, tasks: list[Task], settings: GenerationSettings) -> RolloutBatch:
        self.rolled.append([t.id for t in tasks[::G]])
        return RolloutBatch.from_trajectories([trajectory(t, i) for i, t in enumerate(tasks)], G, pad_id=0)

    def _rewards(self, rollouts: RolloutBatch) -> dict[str, float]:
        rollouts.rewards = torch.tensor([r for t in rollouts.trajectories[::G] for r in self.scores[t.task.id]])
        rollouts.reward_components = {"score": rollouts.rewards * 2}
        return {"nonfinite_rewards": 0.0, "frac_reward_nan": float(rollouts.rewards.isnan().float().mean())}

    def log_dict(self, metrics: dict[str, float], **kwargs) -> None:
        self.logged = metrics


def first_batch(stub: Stub, ids: list[str]) -> tuple[RolloutBatch, dict[str, float]]:
    rollouts = stub.rollout([t for i in ids for t in [TASKS[int(i[1])]] * G], stub.generation)
    return rollouts, stub._rewards(rollouts)


def sampler(**kwargs) -> DynamicSampling:
    out = DynamicSampling(**kwargs)
    out.setup(SimpleNamespace(train_tasks=TASKS))
    return out


def test_varied_groups_need_two_distinct_finite_rewards() -> None:
    # G = 3: [1,1,1] equal; [0,1,0] varies; [NaN,2,2] finite ones equal; all NaN; one finite; [0,NaN,1] varies
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, NAN, 2, 2, NAN, NAN, NAN, NAN, 3, NAN, 0, NAN, 1.0])
    assert varied_groups(rewards, 3) == [1, 5]


def test_select_and_concat_rebuild_what_from_trajectories_builds() -> None:
    trajectories = [trajectory(TASKS[i // G], i) for i in range(6)]  # 3 groups, response widths 1..3
    batch = RolloutBatch.from_trajectories(trajectories, G, pad_id=0)
    batch.rewards, batch.turn_rewards = torch.arange(6.0), torch.arange(12.0)
    batch.reward_components = {"score": -torch.arange(6.0)}
    picked = concat_batches([select_groups(batch, [2, 0]), select_groups(batch, [1])], pad_id=0)
    order = [4, 5, 0, 1, 2, 3]  # trajectories of groups 2, 0, 1
    expected = RolloutBatch.from_trajectories([trajectories[i] for i in order], G, pad_id=0)
    for name in (
        "response_ids",
        "response_mask",
        "rollout_logprobs",
        "turn_to_trajectory",
        "memory_turns",
        "truncated",
    ):
        assert torch.equal(getattr(picked, name), getattr(expected, name)), name
    assert picked.prompt_ids == expected.prompt_ids and picked.trajectories == expected.trajectories
    assert picked.rewards.tolist() == [4, 5, 0, 1, 2, 3]
    assert picked.reward_components["score"].tolist() == [-4, -5, 0, -1, -2, -3]
    assert picked.turn_rewards.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]  # two turns per trajectory


def test_refill_rounds_until_the_batch_is_full() -> None:
    # first batch t0 [NaN, NaN] (dropped), t1 [0, 1] (kept): 1 of 2 groups
    # round 1 draws t2, t4: t2 [0.5, 0.5] dropped, t4 [0, 2] kept -> 2 groups: stop
    stub = Stub({"t0": [NAN, NAN], "t1": [0.0, 1.0], "t2": [0.5, 0.5], "t4": [0.0, 2.0]})
    rollouts, stats = first_batch(stub, ["t0", "t1"])  # 2 of 4 rewards NaN
    stats["nonfinite_rewards"] = 1.0
    out = sampler().resample(stub, rollouts, stats, num_groups=2)
    assert stub.rolled == [["t0", "t1"], ["t2", "t4"]]
    assert [t.task.id for t in out.trajectories] == ["t1", "t1", "t4", "t4"]
    assert out.rewards.tolist() == [0.0, 1.0, 0.0, 2.0] and out.reward_components["score"].tolist() == [0, 2, 0, 4]
    assert out.turn_to_trajectory.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # NaN rewards over both rounds: 2 of 8 trajectories; the refill added no non-finite value
    assert stats == {"nonfinite_rewards": 1.0, "frac_reward_nan": 0.25}
    logged = {k.removeprefix("train/dynamic_sampling/"): v for k, v in stub.logged.items() if "refill_s" not in k}
    assert logged == {"kept_groups": 2, "dropped_groups": 2, "extra_batches": 1, "extra_rollouts": 4, "empty_steps": 0}


def test_rounds_stop_at_max_extra_batches_and_the_surplus_is_not_used() -> None:
    # max 1 round: t0, t1 both equal (0 kept); round 1: t2 [1, 0] and t4 [3, 4] both vary -> 2 kept
    stub = Stub({"t0": [1.0, 1.0], "t1": [0.0, 0.0], "t2": [1.0, 0.0], "t4": [3.0, 4.0]})
    out = sampler(max_extra_batches=1).resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=2)
    assert [t.task.id for t in out.trajectories[::G]] == ["t2", "t4"]
    # one group needed, two varied: t2 is used, t4 is surplus
    stub = Stub({"t0": [1.0, 1.0], "t1": [0.0, 1.0], "t2": [1.0, 0.0], "t4": [3.0, 4.0]})
    out = sampler(max_extra_batches=1).resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=2)
    assert [t.task.id for t in out.trajectories[::G]] == ["t1", "t2"]
    assert stub.logged["train/dynamic_sampling/dropped_groups"] == 1.0  # t0 only: t4 varied, unused
    # rounds exhausted with one group short: t0, t1 equal; round 1: t2 equal, t4 varies -> train on 1 group
    stub = Stub({"t0": [1.0, 1.0], "t1": [0.0, 0.0], "t2": [1.0, 1.0], "t4": [3.0, 4.0]})
    out = sampler(max_extra_batches=1).resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=2)
    assert [t.task.id for t in out.trajectories] == ["t4", "t4"] and stub.logged[
        "train/dynamic_sampling/kept_groups"
    ] == 1


def test_a_full_batch_is_returned_as_it_is() -> None:
    stub = Stub({"t0": [1.0, 0.0], "t1": [0.0, 1.0]})
    rollouts, stats = first_batch(stub, ["t0", "t1"])
    assert sampler().resample(stub, rollouts, stats, num_groups=2) is rollouts
    assert len(stub.rolled) == 1 and stub.logged["train/dynamic_sampling/extra_batches"] == 0


def test_a_step_that_keeps_nothing_trains_nothing_and_too_many_stop_the_run() -> None:
    stub = Stub({t.id: [1.0, 1.0] for t in TASKS})
    sampling = sampler(max_extra_batches=2, max_consecutive_empty_steps=2)
    empty = sampling.resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=2)
    assert empty.num_trajectories == 0 and empty.response_ids.shape[0] == 0 and empty.rewards.numel() == 0
    assert stub.rolled == [["t0", "t1"], ["t2", "t4"], ["t5", "t0"]]  # two refill rounds, all equal
    assert (
        stub.logged["train/dynamic_sampling/empty_steps"] == 1
        and stub.logged["train/dynamic_sampling/kept_groups"] == 0
    )
    assert stub.logged["train/dynamic_sampling/dropped_groups"] == 6
    message = "dynamic sampling: 2 steps in a row kept no group"
    with pytest.raises(EmptyStepsError, match=re.escape(message)):
        sampling.resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=2)
    # a kept group resets the run of empty steps, not the total
    sampling = sampler(max_consecutive_empty_steps=2)
    sampling.load_state_dict({"empty_steps": 3, "consecutive_empty": 1})
    stub.scores["t1"] = [0.0, 1.0]
    sampling.resample(stub, *first_batch(stub, ["t0", "t1"]), num_groups=1)
    assert (sampling.empty_steps, sampling.consecutive_empty) == (3, 0)


def test_the_refill_generator_resumes_from_its_state() -> None:
    straight = sampler()
    draws = [[t.id for t in straight.draw(2)] for _ in range(4)]
    assert draws == [["t2", "t4"], ["t5", "t0"], ["t5", "t0"], ["t4", "t2"]]
    first = sampler()
    first.draw(2), first.draw(2)
    resumed = sampler(seed=123)  # state overrides the seed
    resumed.load_state_dict(first.state_dict())
    assert [[t.id for t in resumed.draw(2)] for _ in range(2)] == draws[2:]


def test_a_pickled_sampler_leaves_the_training_tasks_out() -> None:
    # the module's hyperparameters, pickled into every checkpoint, hold the sampler
    copy = pickle.loads(pickle.dumps(sampler()))
    assert copy.tasks == [] and copy.max_extra_batches == 9
    assert [t.id for t in sampler().draw(2)] == ["t2", "t4"]


def test_options_and_a_fit_without_training_tasks_are_named() -> None:
    with pytest.raises(ConfigError, match=re.escape("model.init_args.dynamic_sampling.init_args.max_extra_batches")):
        DynamicSampling(max_extra_batches=-1)
    with pytest.raises(
        ConfigError, match=re.escape("this fit has no datamodule: train with lightning_memrl.MemRLDataModule")
    ):
        DynamicSampling().setup(None)


class Constant(RewardFunction):
    default_name = "constant"

    def score_answer(self, completion: str, answers: list[str]) -> float:
        return 1.0


class Logged(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_the_training_loop_runs_steps_that_keep_nothing_without_changing_a_weight(tmp_path) -> None:
    """Every group's rewards equal: each step trains an empty batch (no gradient), counted and logged."""
    module = MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=4),
        rewards=[Constant()],
        generation=GenerationSettings(max_new_tokens=4),
        dynamic_sampling=DynamicSampling(max_extra_batches=1, max_consecutive_empty_steps=3),
    )
    data = MemRLDataModule(batch_size=1, synthetic=SyntheticTaskSettings(num_tasks=4, min_chunks=1, max_chunks=1))
    logged = Logged()
    trainer = quiet_trainer(tmp_path, steps=2, callbacks=[logged])
    module.configure_model()
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer.fit(module, data)
    assert trainer.global_step == 2 and module.dynamic_sampling.empty_steps == 2
    assert all(torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert not trainer.optimizers[0].state  # AdamW saw no gradient: no moments
    assert [row["train/dynamic_sampling/empty_steps"] for row in logged.rows] == [1.0, 2.0]
    # per step: the first batch's group and one refill round's group, both dropped
    assert [row["train/dynamic_sampling/dropped_groups"] for row in logged.rows] == [2.0, 2.0]
    assert all(math.isnan(row["train/reward"]) and row["train/loss"] == 0.0 for row in logged.rows)


def _ds_metrics(cwd: Path) -> dict[int, list[float]]:
    """Loss, reward and the dynamic-sampling counts by optimizer step (1-based) over every metrics.csv of a run."""
    keys = ["train/loss", "train/reward"] + [f"train/dynamic_sampling/{k}" for k in ("kept_groups", "dropped_groups")]
    out = {}
    for path in sorted((cwd / "logs" / "tiny" / "csv").glob("version_*/metrics.csv")):
        for row in csv.DictReader(open(path)):
            if row.get("train/loss"):
                out[int(row["step"]) + 1] = [float(row[k]) for k in keys]
    return out


def test_a_resumed_run_draws_and_trains_what_an_uninterrupted_run_does(tmp_path) -> None:
    """Stopped after step 3 and resumed: steps 4-6 draw the same refills (same kept and dropped groups), log
    the same loss and reward (NaN on a step that kept nothing), and end on the same weights."""
    from test_resume import _run, _weights

    overlay = ["--config", str(REPO / "examples" / "credit" / "dynamic_sampling.yaml")]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir(), resumed.mkdir()
    _run(straight, 8, *overlay)
    _run(resumed, 8, *overlay, "--trainer.max_steps", "3")
    _run(resumed, 8, *overlay, "--ckpt_path", "last")
    a, b = _ds_metrics(resumed), _ds_metrics(straight)
    for step in range(4, 7):
        assert a[step] == pytest.approx(b[step], abs=1e-6, nan_ok=True), (step, a[step], b[step])
    assert sum(b[step][2] for step in range(4, 7)) > 0  # something was trained after the resume
    wa, wb = _weights(resumed), _weights(straight)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
