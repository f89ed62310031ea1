"""Advantage estimators: GroupRelative against numbers worked out by hand, the estimator contract,
and the RLOO example (examples/custom_advantages.py) as a unit and through the real command line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import turn_batch

from lightning_memrl.advantages import AdvantageEstimator, GroupRelative, assign_advantages
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import RolloutBatch

NAN = float("nan")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-6)


def group_relative(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4):
    return GroupRelative(scale_rewards, eps).from_rewards(rewards, group_size)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- GroupRelative (GRPO, Dr. GRPO)
def test_group_scale_unbiased_std() -> None:
    # group 1: [1, 2, 3]: mean 2, centred [-1, 0, 1], unbiased var (1+0+1)/2 = 1, std 1
    # group 2: [0, 0, 4]: mean 4/3, centred [-4/3, -4/3, 8/3]
    #   sum of squares 16/9 + 16/9 + 64/9 = 96/9, unbiased var 96/9/2 = 16/3, std 4/sqrt(3)
    #   -> (-4/3)/(4/sqrt3) = -1/sqrt3 = -0.5773503, (8/3)/(4/sqrt3) = 2/sqrt3 = 1.1547005
    adv = group_relative(torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0]), group_size=3, scale_rewards="group", eps=0.0)
    close(adv, [-1.0, 0.0, 1.0, -0.5773503, -0.5773503, 1.1547005])


def test_group_scale_eps_is_added_to_std() -> None:
    # [1, 2, 3] -> centred [-1, 0, 1], std 1; with eps = 0.5 the divisor is 1.5
    adv = group_relative(torch.tensor([1.0, 2.0, 3.0]), group_size=3, scale_rewards="group", eps=0.5)
    close(adv, [-2.0 / 3.0, 0.0, 2.0 / 3.0])
    # default eps 1e-4: -1 / 1.0001 = -0.99990001
    adv = group_relative(torch.tensor([1.0, 2.0, 3.0]), group_size=3)
    close(adv, [-0.99990001, 0.0, 0.99990001])


def test_group_scale_is_default() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert torch.equal(group_relative(rewards, 2), group_relative(rewards, 2, "group"))


def test_batch_scale_mean_per_group_std_over_batch() -> None:
    # same rewards as above; centred per group: [-1, 0, 1, -4/3, -4/3, 8/3]
    # batch std over all six rewards 1, 2, 3, 0, 0, 4: mean 10/6 = 5/3
    #   deviations -2/3, 1/3, 4/3, -5/3, -5/3, 7/3; squares (4+1+16+25+25+49)/9 = 120/9 = 40/3
    #   unbiased var 40/3/5 = 8/3, std sqrt(8/3) = 1.6329932, 1/std = sqrt(3/8) = 0.6123724
    # -> [-0.6123724, 0, 0.6123724, -4/3*0.6123724 = -0.8164966, -0.8164966, 8/3*0.6123724 = 1.6329932]
    adv = group_relative(torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0]), group_size=3, scale_rewards="batch", eps=0.0)
    close(adv, [-0.6123724, 0.0, 0.6123724, -0.8164966, -0.8164966, 1.6329932])


def test_batch_scale_all_equal_batch_gives_zero() -> None:
    adv = group_relative(torch.tensor([2.0, 2.0, 2.0, 2.0]), group_size=2, scale_rewards="batch")
    assert torch.equal(adv, torch.zeros(4))


def test_none_scale_only_centres() -> None:
    # [1, 2, 3] - 2 = [-1, 0, 1]; [0, 0, 4] - 4/3 = [-4/3, -4/3, 8/3]
    adv = group_relative(torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0]), group_size=3, scale_rewards="none")
    close(adv, [-1.0, 0.0, 1.0, -4.0 / 3.0, -4.0 / 3.0, 8.0 / 3.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_is_exactly_zero(scale: str) -> None:
    # group 1 all equal to 0.7 -> exactly 0 (not a tiny number, not NaN); group 2 varies
    adv = group_relative(torch.tensor([0.7, 0.7, 0.7, 0.0, 1.0, 1.0]), group_size=3, scale_rewards=scale)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert not torch.isnan(adv).any()
    assert adv[3] < 0 < adv[4]


def test_nan_reward_excluded_from_group_stats() -> None:
    # group [1, NaN, 3, 5]: valid 1, 3, 5 -> mean 3, centred [-2, ., 0, 2]
    # unbiased var (4 + 0 + 4)/2 = 4, std 2 -> [-1, 0 (NaN), 0, 1]
    adv = group_relative(torch.tensor([1.0, NAN, 3.0, 5.0]), group_size=4, scale_rewards="group", eps=0.0)
    close(adv, [-1.0, 0.0, 0.0, 1.0])
    assert adv[1].item() == 0.0
    # "none": centred only -> [-2, 0, 0, 2]
    adv = group_relative(torch.tensor([1.0, NAN, 3.0, 5.0]), group_size=4, scale_rewards="none")
    close(adv, [-2.0, 0.0, 0.0, 2.0])


def test_nan_reward_excluded_from_batch_std() -> None:
    # groups [0, 2] and [4, NaN] (group_size 2)
    # group 1: mean 1, centred [-1, 1]; group 2 has a single valid reward -> 0, 0
    # batch std over valid 0, 2, 4: mean 2, var (4+0+4)/2 = 4, std 2 -> [-0.5, 0.5, 0, 0]
    adv = group_relative(torch.tensor([0.0, 2.0, 4.0, NAN]), group_size=2, scale_rewards="batch", eps=0.0)
    close(adv, [-0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_valid_reward_gets_zero(scale: str) -> None:
    # group 1: only 7 is valid -> both 0; group 2 all NaN -> both 0; group 3 normal
    adv = group_relative(torch.tensor([NAN, 7.0, NAN, NAN, 0.0, 1.0]), group_size=2, scale_rewards=scale)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4] < 0 < adv[5]


def test_group_relative_bad_arguments() -> None:
    with pytest.raises(ValueError):
        group_relative(torch.zeros(5), group_size=2)  # not a multiple
    with pytest.raises(ValueError):
        group_relative(torch.zeros(2, 2), group_size=2)  # not 1-D
    message = "model.init_args.advantage.init_args.scale_rewards must be 'group', 'batch' or 'none' (got 'std')"
    with pytest.raises(ConfigError, match=re.escape(message)):
        GroupRelative("std")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("model.init_args.advantage.init_args.eps must be >= 0.0")):
        GroupRelative(eps=-1.0)


def test_group_relative_zero_group_size_is_value_error() -> None:
    with pytest.raises(ValueError):
        group_relative(torch.zeros(4), group_size=0)


def test_group_relative_accepts_integer_rewards() -> None:
    adv = group_relative(torch.tensor([0, 1]), group_size=2, scale_rewards="none")
    close(adv, [-0.5, 0.5])


# --------------------------------------------------------------------------- the estimator contract
def test_assign_advantages_broadcasts_to_the_tokens_of_each_trajectorys_turns() -> None:
    # rewards [0, 1 | 5, 5], G = 2, scale none: advantages [-0.5, 0.5, 0, 0]; trajectory 1 has two turns
    batch = turn_batch([0.0, 1.0, 5.0, 5.0], 2, turns=[0, 1, 1, 3])
    assign_advantages(batch, GroupRelative("none"))
    close(batch.trajectory_advantages, [-0.5, 0.5, 0.0, 0.0])
    close(batch.advantages, [[-0.5, -0.5, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])


class _PerTurn(AdvantageEstimator):
    """Returns one number per turn instead of per trajectory: a contract violation."""

    def __call__(self, rollouts: RolloutBatch) -> torch.Tensor:
        return torch.ones(len(rollouts.prompt_ids))


def test_an_estimator_with_the_wrong_shape_is_named() -> None:
    batch = turn_batch([0.0, 1.0], 2, turns=[0, 0, 1])
    with pytest.raises(ValueError, match=re.escape("advantage estimator _PerTurn returned (3,); expected one")):
        assign_advantages(batch, _PerTurn())


def test_the_base_estimator_says_what_to_implement() -> None:
    with pytest.raises(NotImplementedError, match=re.escape("must implement from_rewards(rewards, group_size)")):
        AdvantageEstimator()(turn_batch([0.0, 1.0], 2, turns=[0, 1]))


# --------------------------------------------------------------------------- the RLOO example
def test_rloo_example_on_hand_computed_numbers(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from custom_advantages import RLOO

    # A_i = r_i - (sum_j r_j - r_i) / (k - 1) over the k valid rewards of the group
    # group 1: [1, 2, 3, 6], sum 12, k 4: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3
    # group 2: [0, NaN, 4, 4], sum 8, k 3: 0 - 8/2, NaN -> 0, 4 - 4/2, 4 - 4/2
    # group 3: [NaN, 5, NaN, NaN]: one valid reward, no baseline -> all 0
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, NAN, 4.0, 4.0, NAN, 5.0, NAN, NAN])
    expected = [-8 / 3, -4 / 3, 0.0, 4.0, -4.0, 0.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    close(RLOO().from_rewards(rewards, group_size=4), expected)
    # equal rewards give 0; with G = 2 RLOO is r_i - r_j
    close(RLOO().from_rewards(torch.tensor([3.0, 3.0, 1.0, 4.0]), group_size=2), [0.0, 0.0, -3.0, 3.0])
