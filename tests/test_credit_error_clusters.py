"""ErrorClusterPenalty (MEDS) on hand-built vectors and batches; its pooling against a direct tiny-model forward."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from teacher_fakes import FakeModule

from lightning_memrl.credit.error_clusters import (
    ErrorClusterPenalty,
    cluster_penalty,
    density_clusters,
    pooled_hidden_states,
)
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import ANSWER_TURN, Generation, RolloutBatch, Task, Trajectory, Turn


def v(*x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float)


# Two tight chains (0.01 apart after normalisation) near e1 and e2, 1.414 apart; the noise points sit in the
# negative orthant, 1.613 from both chains and 1.809 from each other, so single linkage joins them last, one
# at a time: HDBSCAN (min_cluster_size 2, min_samples 1) finds the two chains and leaves them as noise.
A = [v(1, 0, 0, 0.00), v(1, 0, 0, 0.01), v(1, 0, 0, 0.02)]
B = [v(0, 1, 0, 0.00), v(0, 1, 0, 0.01)]
NOISE = v(-1, -1, 3, 0)
Q_A, Q_B, Q_NOISE = v(1, 0, 0, 0.03), v(0, 1, 0, 0.02), v(-1, -1, -3, 0)

OK, BAD = "\\boxed{Paris}", "\\boxed{Rome}"


def test_density_clusters_finds_two_tight_clusters_and_noise():
    labels = density_clusters(F.normalize(torch.stack([*A, *B, NOISE]), dim=-1)).tolist()
    assert labels[0] == labels[1] == labels[2] >= 0 and labels[3] == labels[4] >= 0
    assert labels[0] != labels[3] and labels[5] == -1
    assert density_clusters(torch.stack([A[0]])).tolist() == [-1]  # fewer points than min_cluster_size


def test_cluster_penalty_by_hand():
    # min(0.1·ln(|C|+1), 0.5): |C|=0 -> 0 (noise / new pattern); 1 -> 0.1·ln2 = 0.069315; 3 -> 0.1·ln4 = 0.138629;
    # 100 -> 0.1·ln101 = 0.461512; 1000 -> 0.1·ln1001 = 0.690875, capped at 0.5
    got = cluster_penalty(torch.tensor([0, 1, 3, 100, 1000]), alpha=0.1, max_penalty=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.069315, 0.138629, 0.461512, 0.5]), atol=1e-6, rtol=0)


def _trajectory(task_id: str, answer: str, vector: torch.Tensor | None = None) -> Trajectory:
    turn = Turn(ANSWER_TURN, [1, 2], Generation([3, 4], torch.zeros(2), False), answer)
    task = Task(f"question {task_id}?", ["c"], ["Paris"], id=task_id)
    return Trajectory(task=task, turns=[turn], info={} if vector is None else {"vector": vector})


def _batch(rows: list[tuple[str, str, torch.Tensor | None]], group_size: int) -> RolloutBatch:
    rollouts = RolloutBatch.from_trajectories([_trajectory(*row) for row in rows], group_size, pad_id=0)
    rollouts.rewards = torch.tensor([1.0 if answer == OK else 0.0 for _, answer, _ in rows])
    return rollouts


def _fake_teacher(callback: ErrorClusterPenalty, monkeypatch) -> list[torch.Tensor]:
    """Pooled states read from each trajectory's ``info['vector']``; records what was asked."""
    asked: list[torch.Tensor] = []

    def fake(module, trajectories):
        vectors = torch.stack([t.info["vector"] for t in trajectories])
        asked.extend(vectors)
        return vectors

    monkeypatch.setattr(callback, "pooled_states", fake)
    return asked


STEP1 = [("t0", OK, None)] + [("t0", BAD, x) for x in (*A, *B, NOISE)]
STEP2 = [("t0", OK, None), ("t0", BAD, Q_A), ("t0", BAD, Q_B), ("t0", BAD, Q_NOISE)]
STEP2 += [("t1", BAD, Q_A), ("t1", OK, None), ("t1", OK, None), ("t1", OK, None)]


def test_error_cluster_penalty_two_steps_by_hand(monkeypatch):
    callback = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4)
    asked = _fake_teacher(callback, monkeypatch)
    module = FakeModule()
    step1 = _batch(STEP1, group_size=7)
    callback.on_rewards(None, module, step1)
    # step 1: the buffer was empty, so no failure has a remembered cluster -> no penalty; 6 failures kept
    torch.testing.assert_close(step1.rewards, torch.tensor([1.0] + [0.0] * 6))
    assert len(asked) == 6  # the success is not pooled
    assert module.logged["train/error_clusters/buffer"] == 6.0 and module.logged["train/error_clusters/clusters"] == 2.0
    assert module.logged["train/error_clusters/penalty"] == 0.0

    step2 = _batch(STEP2, group_size=4)
    callback.on_rewards(None, module, step2)
    # task t0: Q_A joins A (3 remembered members): min(0.3·ln4 = 0.415888, 0.4) = 0.4
    #          Q_B joins B (2 remembered):         min(0.3·ln3 = 0.329584, 0.4) = 0.329584
    #          Q_NOISE stays noise -> 0; the successes -> 0
    # task t1: its failure is alone in its group (group_by task) -> noise -> 0
    p_a, p_b = 0.4, 0.3 * math.log(3)
    expected = torch.tensor([1.0, -p_a, -p_b, 0.0, 0.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(step2.rewards, expected, atol=1e-6, rtol=0)
    assert module.logged["train/error_clusters/penalty"] == pytest.approx((p_a + p_b) / 8)
    assert module.logged["train/error_clusters/buffer"] == 10.0  # 6 + 4 failures
    assert module.logged["train/error_clusters/clusters"] == 2.0  # t0's two; t1 has one point
    assert module.logged["train/error_clusters/failures"] == 4.0


def test_group_by_all_clusters_tasks_together(monkeypatch):
    callback = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4, group_by="all")
    _fake_teacher(callback, monkeypatch)
    callback.on_rewards(None, FakeModule(), _batch(STEP1, group_size=7))
    step2 = _batch(STEP2, group_size=4)
    callback.on_rewards(None, FakeModule(), step2)
    # t1's failure now meets t0's cluster A (3 remembered members): 0.4 as for t0's Q_A
    assert step2.rewards[4].item() == pytest.approx(-0.4)


def test_buffer_keeps_the_newest_failures(monkeypatch):
    # buffer_size 5: of step 1's 6 failures A0 A1 A2 B0 B1 N the oldest (A0) goes; A1 A2 and B0 B1 stay clusters
    callback = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4, buffer_size=5)
    _fake_teacher(callback, monkeypatch)
    module = FakeModule()
    callback.on_rewards(None, module, _batch(STEP1, group_size=7))
    torch.testing.assert_close(callback.vectors, F.normalize(torch.stack([A[1], A[2], *B, NOISE]), dim=-1))
    assert module.logged["train/error_clusters/buffer"] == 5.0 and module.logged["train/error_clusters/clusters"] == 2.0
    step2 = _batch([("t0", OK, None), ("t0", BAD, Q_A)], group_size=2)
    callback.on_rewards(None, module, step2)
    # Q_A pushes A1 out: its cluster {A2, Q_A} has 1 remembered member -> 0.3·ln2 = 0.207944 (unbounded: 3 -> 0.4)
    torch.testing.assert_close(step2.rewards, torch.tensor([1.0, -0.3 * math.log(2)]), atol=1e-6, rtol=0)
    assert len(callback.keys) == 5


def test_a_step_with_more_failures_than_the_buffer_keeps_its_last(monkeypatch):
    callback = ErrorClusterPenalty(buffer_size=2)
    _fake_teacher(callback, monkeypatch)
    step1 = _batch(STEP1, group_size=7)
    callback.on_rewards(None, FakeModule(), step1)
    torch.testing.assert_close(callback.vectors, F.normalize(torch.stack([B[1], NOISE]), dim=-1))
    torch.testing.assert_close(step1.rewards, torch.tensor([1.0] + [0.0] * 6))


def test_state_dict_round_trip_keeps_the_buffer(monkeypatch):
    first = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4)
    _fake_teacher(first, monkeypatch)
    first.on_rewards(None, FakeModule(), _batch(STEP1, group_size=7))
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4)
    resumed.load_state_dict(torch.load(saved))
    assert resumed.keys == first.keys and torch.equal(resumed.labels, first.labels)
    torch.testing.assert_close(resumed.vectors, first.vectors)
    _fake_teacher(resumed, monkeypatch)
    step2 = _batch(STEP2, group_size=4)
    resumed.on_rewards(None, FakeModule(), step2)
    assert step2.rewards[:3].tolist() == pytest.approx([1.0, -0.4, -0.3 * math.log(3)])  # as without the resume
    fresh = ErrorClusterPenalty(alpha=0.3, max_penalty=0.4)
    _fake_teacher(fresh, monkeypatch)
    again = _batch(STEP2, group_size=4)
    fresh.on_rewards(None, FakeModule(), again)
    assert again.rewards[:3].tolist() == [1.0, 0.0, 0.0]  # no memory, no penalty


def test_a_buffer_of_another_width_is_refused(monkeypatch):
    callback = ErrorClusterPenalty()
    callback.load_state_dict({"keys": ["t0"], "vectors": torch.ones(1, 3), "labels": torch.tensor([-1])})
    _fake_teacher(callback, monkeypatch)
    with pytest.raises(ValueError, match="remembered failures have 3 features but this model's hidden states have 4"):
        callback.on_rewards(None, FakeModule(), _batch([("t0", BAD, Q_A)], group_size=1))


def test_options_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="ErrorClusterPenalty.alpha"):
        ErrorClusterPenalty(alpha=-1.0)
    with pytest.raises(ConfigError, match="ErrorClusterPenalty.min_cluster_size"):
        ErrorClusterPenalty(min_cluster_size=1)
    with pytest.raises(ConfigError, match="group_by must be one of task, all"):
        ErrorClusterPenalty(group_by="prompt")
    with pytest.raises(ValueError, match="ErrorClusterPenalty.answer_pattern"):
        ErrorClusterPenalty(answer_pattern="[")


def test_pooled_hidden_states_match_a_direct_forward(tiny_model, tiny_tokenizer):
    prompts, responses = [[5, 6, 7, 8, 9], [10, 11]], [[12, 13], [14, 15, 16, 17]]
    expected = []
    for prompt, response in zip(prompts, responses):  # one unpadded row at a time: last layer, mean over the response
        with torch.no_grad():
            out = tiny_model(torch.tensor([prompt + response]), output_hidden_states=True)
        expected.append(out.hidden_states[-1][0, len(prompt) :].mean(0))
    pad = tiny_tokenizer.pad_token_id
    for budget in (64, 1):  # one padded micro-batch; one row per micro-batch
        got = pooled_hidden_states(tiny_model, prompts, responses, pad, "cpu", budget)
        assert got.shape == (2, tiny_model.config.hidden_size)
        torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=1e-4)
