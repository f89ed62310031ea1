"""InformationGainReward (InfoMem) on hand-built MemAgent batches with a faked teacher."""

from __future__ import annotations

import pytest
import torch
from teacher_fakes import FakeModule, batch, fake_scores, memagent_trajectory

from lightning_memrl.credit.info_gain import InformationGainReward, information_gain_bonus
from lightning_memrl.errors import ConfigError

Z = 0.5**0.5


def test_information_gain_bonus_by_hand():
    # group 0: successes 0, 1 with gains [0.5, 1.5] -> mean 1, std 0.7071 -> [-Z, +Z]; member 2 failed -> 0
    # group 1: one success (gain 2.0) -> nothing to compare -> 0
    gains = torch.tensor([0.5, 1.5, 9.0, 2.0, 7.0, 7.0])
    success = torch.tensor([True, True, False, True, False, False])
    got = information_gain_bonus(gains, success, group_size=3)
    torch.testing.assert_close(got, torch.tensor([-Z, Z, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_info_gain_scores_only_successes_and_adds_the_weighted_bonus(monkeypatch):
    # per-token log-likelihoods: empty -3.0; m0 -2.5 (gain 0.5); m1 -1.5 (gain 1.5); m3 -1.0 (gain 2.0)
    # success = exact match of the final answer with "Paris" (rewards include a 0.1 format bonus: not success)
    # bonus: group 0 [-Z, +Z, 0], group 1 [0, 0, 0]; weight 0.1
    per_token = {"": -3.0, "m0": -2.5, "m1": -1.5, "m3": -1.0}
    asked: list[str] = []

    def fake(module, pairs):
        asked.extend(m for _, m in pairs)
        return fake_scores([per_token[m] for _, m in pairs], length=3)

    ok, bad = "\\boxed{Paris}", "\\boxed{Rome}"
    answers = [ok, ok, bad, ok, bad, bad]
    trajectories = [memagent_trajectory(["x", f"m{i}"], answer=a) for i, a in enumerate(answers)]
    rollouts = batch(trajectories, 3, [0.0] * 6)
    rollouts.rewards = torch.tensor([1.1, 1.1, 0.1, 1.1, 0.0, 0.1])
    callback = InformationGainReward(weight=0.1)
    monkeypatch.setattr(callback, "score_memories", fake)
    module = FakeModule()
    callback.on_rewards(None, module, rollouts)
    assert asked == ["", "m0", "", "m1", "", "m3"]  # the final memory of successes only, each against empty
    d = 0.1 * Z
    torch.testing.assert_close(
        rollouts.rewards, torch.tensor([1.1 - d, 1.1 + d, 0.1, 1.1, 0.0, 0.1]), atol=1e-6, rtol=0
    )
    assert module.logged["train/info_gain/success_rate"] == pytest.approx(0.5)
    assert module.logged["train/info_gain/gain"] == pytest.approx((0.5 + 1.5 + 2.0) / 3)
    assert module.logged["train/info_gain/teacher_rows"] == 0.0  # the fake teacher does not count


def test_info_gain_without_success_asks_no_teacher(monkeypatch):
    rollouts = batch([memagent_trajectory(["m"]) for _ in range(2)], 2, [0.0, 0.0])
    rollouts.rewards = torch.tensor([0.1, 0.0])
    callback = InformationGainReward()
    monkeypatch.setattr(callback, "score_memories", lambda *a: pytest.fail("no success: no teacher call"))
    module = FakeModule()
    callback.on_rewards(None, module, rollouts)
    torch.testing.assert_close(rollouts.rewards, torch.tensor([0.1, 0.0]))
    assert module.logged["train/info_gain/success_rate"] == 0.0 and "train/info_gain/gain" not in module.logged


def test_info_gain_rejects_bad_options():
    with pytest.raises(ConfigError, match="weight must be"):
        InformationGainReward(weight=-0.1)
    with pytest.raises(ValueError, match="InformationGainReward.answer_pattern"):
        InformationGainReward(answer_pattern="[")
    with pytest.raises(ConfigError, match="answer_format must contain"):
        InformationGainReward(answer_format="x")
