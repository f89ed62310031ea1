"""PotentialTurnShaping (TIPS / PiCA) on hand-built MemAgent batches with a faked teacher."""

from __future__ import annotations

import pytest
import torch
from teacher_fakes import FakeModule, batch, fake_scores, memagent_trajectory

from lightning_memrl.credit.tips import PotentialTurnShaping, per_turn_index_advantages, shaped_returns
from lightning_memrl.errors import ConfigError

Z = 0.5**0.5  # z-score of the larger of two values: (x - mean) / std, std of two values |a-b|/sqrt(2)


def test_shaped_returns_discounted_by_hand():
    # Φ = [-4, -3, -1], γ = 0.9: r1 = 0.9·(-3) + 4 = 1.3, r2 = 0.9·(-1) + 3 = 2.1; G2 = 2.1, G1 = 1.3 + 0.9·2.1 = 3.19
    rewards, returns = shaped_returns(torch.tensor([-4.0, -3.0, -1.0]), 0.9)
    torch.testing.assert_close(rewards, torch.tensor([1.3, 2.1]))
    torch.testing.assert_close(returns, torch.tensor([3.19, 2.1]))


def test_per_turn_index_advantages_normalise_each_index_within_the_group():
    # group 0: index 0 has [3, 2] -> [+Z, -Z]; index 1 only member 0 reached -> 0. group 1: [5, 5] -> [0, 0]
    got = per_turn_index_advantages(
        [torch.tensor([3.0, 7.0]), torch.tensor([2.0]), torch.tensor([5.0]), torch.tensor([5.0])], group_size=2
    )
    expected = [[Z, 0.0], [-Z], [0.0], [0.0]]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, torch.tensor(e), atol=1e-5, rtol=0)


def test_tips_adds_the_normalised_turn_return_to_memory_turn_tokens(monkeypatch):
    # Φ("") = -4; A: Φ(a1) = -3, Φ(a2) = -1 -> r = [1, 2], G = [3, 2]
    #             B: Φ(b1) = -4, Φ(b2) = -2 -> r = [0, 2], G = [2, 2]
    # index 0: [3, 2] -> [+Z, -Z]; index 1: [2, 2] -> [0, 0]; weight 0.5 -> A turn 0 +0.5·Z, B turn 0 -0.5·Z
    potentials = {"": -4.0, "a1": -3.0, "a2": -1.0, "b1": -4.0, "b2": -2.0}
    asked: list[str] = []

    def fake(module, pairs):
        asked.extend(m for _, m in pairs)
        return fake_scores([potentials[m] / 2 for _, m in pairs])  # total = 2 · mean = Φ

    rollouts = batch([memagent_trajectory(["a1", "a2"]), memagent_trajectory(["b1", "b2"])], 2, [1.0, -1.0])
    callback = PotentialTurnShaping(weight=0.5)
    monkeypatch.setattr(callback, "score_memories", fake)
    module = FakeModule()
    callback.on_advantages(None, module, rollouts)
    assert asked == ["", "a1", "a2", "", "b1", "b2"]  # Φ_0 from the empty memory, then each memory
    bonus = 0.5 * Z
    expected = torch.tensor(
        [[1 + bonus, 1 + bonus], [1.0, 1.0], [1.0, 0.0], [-1 - bonus, -1 - bonus], [-1.0, -1.0], [-1.0, 0.0]]
    )
    torch.testing.assert_close(rollouts.advantages, expected, atol=1e-5, rtol=0)
    assert module.logged["train/tips/potential_gain"] == pytest.approx(2.5)  # mean(Φ_2 - Φ_0) = (3 + 2) / 2
    assert module.logged["train/tips/turn_reward"] == pytest.approx(1.25)  # mean(1, 2, 0, 2)
    assert {"train/tips/teacher_seconds", "train/tips/teacher_rows"} <= set(module.logged)


def test_tips_mean_potential_and_frozen_turns(monkeypatch):
    # potential: mean -> Φ is the per-token mean (fake: total / 2); A's turn 1 is frozen: no row, no bonus.
    # A: Φ = [-2, -1, -1] -> G = [1, 0]; B: Φ = [-2, -2, -2] -> G = [0, 0]; index 0: [1, 0] -> [+Z, -Z]; index 1: 0
    potentials = {"": -2.0, "a1": -1.0, "a2": -1.0, "b1": -2.0, "b2": -2.0}
    rollouts = batch([memagent_trajectory(["a1", "a2"], frozen=(1,)), memagent_trajectory(["b1", "b2"])], 2, [0, 0])
    callback = PotentialTurnShaping(weight=1.0, potential="mean")
    monkeypatch.setattr(
        callback, "score_memories", lambda module, pairs: fake_scores([potentials[m] for _, m in pairs])
    )
    callback.on_advantages(None, FakeModule(), rollouts)
    # rows: A turn 0, A answer, B turn 0, B turn 1, B answer
    expected = torch.tensor([[Z, Z], [0.0, 0.0], [-Z, -Z], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(rollouts.advantages, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"gamma": 0.0}, "gamma must be in"), ({"weight": -1}, "weight must be"), ({"potential": "max"}, "potential")],
)
def test_tips_rejects_bad_options(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PotentialTurnShaping(**kwargs)
