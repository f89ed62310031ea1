"""TurnLevelAdvantage (MemoPilot / AgeMem): per-(group, turn index) normalisation against hand-computed
numbers, and the per-turn path of assign_advantages next to the unchanged per-trajectory one."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import turn_batch

from lightning_memrl.advantages import AdvantageEstimator, GroupRelative, assign_advantages
from lightning_memrl.credit.turn_level import TurnLevelAdvantage, turn_level_rewards, turn_positions
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import RolloutBatch

NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def three_members() -> RolloutBatch:
    # one group of 3: trajectories 0 and 1 have two turns, trajectory 2 one turn
    # turn rewards (rows): t0k0 0.1, t0k1 0, t1k0 -0.1, t1k1 0, t2k0 0.3
    # outcomes 1, 0, 0.5; the module's rewards hold outcome + turn sums: 1.1, -0.1, 0.8
    return turn_batch([1.1, -0.1, 0.8], 3, turns=[0, 0, 1, 1, 2], turn_rewards=[0.1, 0.0, -0.1, 0.0, 0.3])


def test_turn_rewards_add_the_outcome_on_the_last_turn_once() -> None:
    # r = [0.1, 0 + 1, -0.1, 0 + 0, 0.3 + 0.5]; turn 2's only turn is its last
    close(turn_level_rewards(three_members()), [0.1, 1.0, -0.1, 0.0, 0.8])
    assert turn_positions(torch.tensor([0, 0, 1, 1, 2])).tolist() == [0, 1, 0, 1, 0]


def test_normalised_per_turn_index_within_the_group() -> None:
    # k = 0: {0.1, -0.1, 0.8}, mean 0.8/3 = 0.266667, centred [-0.166667, -0.366667, 0.533333]
    #   unbiased var (0.0277778 + 0.1344444 + 0.2844444) / 2 = 0.2233333, std 0.4725816
    #   -> [-0.3526728, -0.7758802, 1.1285530]
    # k = 1: {1, 0} (trajectory 2 has no turn 1), mean 0.5, centred ±0.5, std sqrt(0.5) -> ±0.7071068
    adv = TurnLevelAdvantage(eps=0.0)(three_members())
    close(adv, [-0.3526728, 0.7071068, -0.7758802, -0.7071068, 1.1285530])
    # scale_rewards none: centred only
    close(TurnLevelAdvantage("none")(three_members()), [-1 / 6, 0.5, -11 / 30, -0.5, 8 / 15])


def test_groups_are_separate_and_nan_or_alone_gets_zero() -> None:
    # G = 2; group 0: trajectories 0 (turns k0, k1) and 1 (turn k0 only): k1 of 0 is alone -> 0
    #   r: t0 = [0, 0 + 2], t1 = [0 + 1]; k0 {0, 1} -> [-0.5, 0.5] (none)
    # group 1: trajectory 3's reward is NaN -> its turn 0, and trajectory 2's turn (alone) -> 0
    rollouts = turn_batch([2.0, 1.0, 5.0, NAN], 2, turns=[0, 0, 1, 2, 3], turn_rewards=[0.0, 0.0, 0.0, 0.0, 0.0])
    estimator = TurnLevelAdvantage("none")
    close(estimator(rollouts), [-0.5, 0.0, 0.5, 0.0, 0.0])
    # cells: g0k0 (2 turns), g0k1 (1), g1k0 (1 valid + NaN): 3 of 5 turns unpaired; indices 0, 1
    # valid turn rewards 0, 2, 1, 5: mean 2
    assert estimator.metrics() == {
        "turn_level/turn_indices": 2.0,
        "turn_level/frac_unpaired": 0.6,
        "turn_level/turn_reward": 2.0,
        "turn_level/frac_earlier_turns_rewarded": 0.0,  # trajectory 0's first turn, no turn reward
    }


def test_warns_once_when_no_earlier_turn_has_a_reward(caplog) -> None:
    estimator = TurnLevelAdvantage("none")
    unrewarded = turn_batch([2.0, 1.0], 2, turns=[0, 0, 0, 1], turn_rewards=[0.0, 0.0, 0.0, 0.0])
    with caplog.at_level("WARNING", logger="lightning_memrl.credit.turn_level"):
        estimator(unrewarded)
        estimator(unrewarded)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "(2 such turns in this batch)" in warnings[0] and "GroupRelative" in warnings[0]
    # three_members: the earlier turns t0k0 (0.1) and t1k0 (-0.1) both carry turn rewards: no warning
    caplog.clear()
    fresh = TurnLevelAdvantage("none")
    with caplog.at_level("WARNING", logger="lightning_memrl.credit.turn_level"):
        fresh(three_members())
    assert caplog.records == [] and fresh.metrics()["turn_level/frac_earlier_turns_rewarded"] == 1.0


def test_assign_advantages_gives_each_turn_its_own_advantage() -> None:
    rollouts = three_members()
    assign_advantages(rollouts, TurnLevelAdvantage("none"))
    per_turn = [-1 / 6, 0.5, -11 / 30, -0.5, 8 / 15]
    close(rollouts.advantages, [[a, a, 0.0] for a in per_turn])
    # trajectory advantage = mean of its turns: (-1/6 + 1/2)/2 = 1/6, (-11/30 - 1/2)/2 = -13/30, 8/15
    close(rollouts.trajectory_advantages, [1 / 6, -13 / 30, 8 / 15])


def test_per_trajectory_estimators_are_unchanged() -> None:
    # GroupRelative none on [1.1, -0.1, 0.8]: mean 0.6 -> [0.5, -0.7, 0.2], broadcast over each trajectory's turns
    rollouts = three_members()
    assign_advantages(rollouts, GroupRelative("none"))
    close(rollouts.trajectory_advantages, [0.5, -0.7, 0.2])
    close(rollouts.advantages[:, 0], [0.5, 0.5, -0.7, -0.7, 0.2])
    assert not GroupRelative.per_turn and GroupRelative().metrics() == {}


class _PerTrajectoryButDeclaredPerTurn(AdvantageEstimator):
    per_turn = True

    def __call__(self, rollouts: RolloutBatch) -> torch.Tensor:
        return torch.zeros(rollouts.num_trajectories)


def test_a_per_turn_estimator_with_the_wrong_shape_is_named() -> None:
    message = "returned (3,); expected one advantage per turn, a tensor of shape (5,)"
    with pytest.raises(ValueError, match=re.escape(message)):
        assign_advantages(three_members(), _PerTrajectoryButDeclaredPerTurn())


def test_bad_options_are_named() -> None:
    with pytest.raises(ConfigError, match=re.escape("scale_rewards must be 'group' or 'none'")):
        TurnLevelAdvantage("batch")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("model.init_args.advantage.init_args.eps must be >= 0.0")):
        TurnLevelAdvantage(eps=-1.0)
