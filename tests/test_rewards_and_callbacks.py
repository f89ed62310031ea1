"""Tests of the reward functions and the reward-shaping / credit callbacks, on hand-built batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import answered

from lightning_memrl.callbacks.memory_credit import MemoryTokenCredit, memory_write_credits
from lightning_memrl.callbacks.overlong import OverlongPenalty, soft_overlong_penalty
from lightning_memrl.rewards import (
    BoxedFormat,
    ExactMatch,
    RewardFunction,
    SubExactMatch,
    TokenF1,
    answer_from_completion,
    exact_match,
    extract_boxed,
    normalize_answer,
    sub_exact_match,
    token_f1,
    token_scores,
)
from lightning_memrl.types import ANSWER_TURN, MEMORY_TURN, Generation, RolloutBatch, Task, Trajectory, Turn


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# --------------------------------------------------------------------------- normalize_answer
@pytest.mark.parametrize(
    "text, expected",
    [
        ("PaRiS", "paris"),  # case
        ("Paris!?,.", "paris"),  # punctuation
        ("don't", "dont"),  # punctuation inside a word is deleted, not split
        ("The cat and a dog ate an apple", "cat and dog ate apple"),  # articles
        ("theater another", "theater another"),  # articles only as whole words
        ("  hello \t  world \n", "hello world"),  # whitespace
        ("The  Quick, Brown fox!", "quick brown fox"),  # all of it
        ("the", ""),
        (42, "42"),  # non-str is converted
    ],
)
def test_normalize_answer(text: Any, expected: str) -> None:
    assert normalize_answer(text) == expected


# --------------------------------------------------------------------------- extract_boxed
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"first \boxed{1} then \boxed{42}", "42"),  # the last box
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"x = \boxed{ {a} b } done", "{a} b"),  # stripped, nested
        (r"\boxed{ Paris }", "Paris"),
        (r"\boxed{}", ""),
        ("no box at all", None),
        (r"\boxed{abc", None),  # unclosed
        (r"\boxed{a{b}", None),  # unclosed after a nested pair
        (r"\boxed{1} and \boxed{2", None),  # the last box is unclosed
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_answer_from_completion() -> None:
    assert answer_from_completion(r"so it is \boxed{Rome}.") == "Rome"
    assert answer_from_completion("  Rome \n") == "Rome"


# --------------------------------------------------------------------------- scoring functions
def test_exact_match() -> None:
    assert exact_match("The Paris!", ["paris"]) == 1.0
    assert exact_match("Paris France", ["paris"]) == 0.0
    assert exact_match("Lyon", ["Paris", "lyon"]) == 1.0  # any gold answer
    assert exact_match("Lyon", []) == 0.0


def test_sub_exact_match() -> None:
    assert sub_exact_match("it is Paris, France", ["paris"]) == 1.0
    assert sub_exact_match("par", ["paris"]) == 0.0
    assert sub_exact_match("in Rome", ["paris", "rome"]) == 1.0
    # a gold answer that normalises to "" must not match everything
    assert sub_exact_match("anything", ["the"]) == 0.0


def test_token_f1_partial_overlap() -> None:
    # prediction "the cat sat on mat" -> [cat, sat, on, mat] (4 tokens)
    # gold "a cat on the mat"          -> [cat, on, mat]      (3 tokens)
    # common 3: precision 3/4, recall 3/3 = 1 -> F1 = 2 * 3/4 * 1 / (3/4 + 1) = 1.5 / 1.75 = 6/7
    assert token_f1("the cat sat on mat", ["a cat on the mat"]) == pytest.approx(6 / 7)


def test_token_f1_counts_repeated_tokens_once_each() -> None:
    # [cat, cat] vs [cat]: common min(2, 1) = 1, P = 1/2, R = 1 -> 2 * 1/2 / (3/2) = 2/3
    assert token_f1("cat cat", ["cat"]) == pytest.approx(2 / 3)


def test_token_f1_takes_max_over_gold_answers() -> None:
    # "cat sat" vs "dog": 0; vs "cat": P = 1/2, R = 1 -> 2/3; vs "sat cat": 1
    assert token_f1("cat sat", ["dog", "cat"]) == pytest.approx(2 / 3)
    assert token_f1("cat sat", ["dog", "cat", "sat cat"]) == pytest.approx(1.0)
    assert token_f1("cat sat", ["dog"]) == 0.0


def test_token_scores_give_precision_and_recall_of_the_best_f1_answer() -> None:
    # "cat sat on mat" [4 tokens] vs "a cat on the mat" [cat, on, mat]: common 3, P 3/4, R 1, F1 6/7;
    # vs "mat": common 1, P 1/4, R 1, F1 2/5: the first answer is the best one
    scores = token_scores("cat sat on mat", ["mat", "a cat on the mat"])
    assert scores == pytest.approx((6 / 7, 3 / 4, 1.0))
    assert token_scores("cat", ["cat sat on mat"]) == pytest.approx((2 / 5, 1.0, 1 / 4))
    assert token_scores("the", ["a"]) == (1.0, 1.0, 1.0) and token_scores("dog", ["cat"]) == (0.0, 0.0, 0.0)


def test_token_f1_empty_sides() -> None:
    assert token_f1("the", ["a"]) == 1.0  # both normalise to nothing
    assert token_f1("", ["cat"]) == 0.0
    assert token_f1("cat", [""]) == 0.0


# --------------------------------------------------------------------------- reward classes
def test_exact_match_reward() -> None:
    fn = ExactMatch()
    assert (fn.name, fn.weight) == ("exact_match", 1.0)
    assert fn(answered(r"The answer is \boxed{Paris}.", ["paris"])) == 1.0
    assert fn(answered(r"\boxed{Lyon}", ["paris"])) == 0.0
    assert fn(answered("Paris", ["paris"])) == 1.0  # no box: the whole completion
    # the boxed answer is compared, not the whole text
    assert fn(answered(r"Paris? No: \boxed{Lyon}", ["paris"])) == 0.0


def test_exact_match_require_boxed() -> None:
    fn = ExactMatch(require_boxed=True, weight=2.0, name="em")
    assert (fn.name, fn.weight, fn.require_boxed) == ("em", 2.0, True)
    assert fn(answered("Paris", ["paris"])) == 0.0
    assert fn(answered(r"\boxed{paris}", ["Paris"])) == 1.0


def test_sub_exact_match_reward() -> None:
    fn = SubExactMatch(weight=0.5)
    assert (fn.name, fn.weight) == ("sub_em", 0.5)
    assert fn(answered(r"\boxed{Paris, France}", ["paris"])) == 1.0
    assert fn(answered(r"Paris was mentioned, but \boxed{Lyon}", ["paris"])) == 0.0


def test_token_f1_reward() -> None:
    fn = TokenF1()
    assert (fn.name, fn.weight) == ("f1", 1.0)
    assert fn(answered(r"so \boxed{the cat sat on mat}", ["a cat on the mat"])) == pytest.approx(6 / 7)


def test_boxed_format_reward() -> None:
    fn = BoxedFormat(name="fmt")
    assert (fn.name, fn.weight) == ("fmt", 1.0)
    assert BoxedFormat().name == "format"
    assert fn(answered(r"answer: \boxed{x}", [])) == 1.0
    assert fn(answered("no box", [])) == 0.0
    assert fn(answered(r"\boxed{}", [])) == 0.0
    assert fn(answered(r"\boxed{ }", [])) == 0.0  # blank after stripping
    assert fn(answered(r"\boxed{x} \boxed{y}", [])) == 0.0  # two boxes
    assert fn(answered(r"\boxed{x", [])) == 0.0  # unclosed


def test_reward_function_base_is_abstract() -> None:
    fn = RewardFunction()
    assert fn.name == "reward"
    with pytest.raises(NotImplementedError):
        fn(answered("x", ["x"]))


def test_reward_sees_the_trajectory_and_old_signature_is_named() -> None:
    class LastMemoryLength(RewardFunction):
        def score(self, trajectory: Trajectory) -> float:
            return float(len(trajectory.memories[-1]))

    assert LastMemoryLength()(answered("x", ["x"], memories=["ab", "abcd"])) == 4.0
    with pytest.raises(TypeError, match=r"Old.score takes more than the trajectory: .* rename .* to score_answer"):

        class Old(RewardFunction):
            def score(self, completion: str, answers: list[str]) -> float:
                return 0.0


# --------------------------------------------------------------------------- helpers for batches
def turn(kind: str, length: int) -> Turn:
    gen = Generation(token_ids=list(range(1, length + 1)), logprobs=torch.full((length,), -0.5), truncated=False)
    return Turn(kind=kind, prompt_ids=[7, 8], generation=gen, text="")


class LogRecorder:
    """Stands in for the LightningModule: records ``log`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.calls.append((name, value))


# --------------------------------------------------------------------------- overlong penalty
def test_soft_overlong_penalty_values() -> None:
    # L_max = 20, L_cache = 5 -> soft start 15
    #   len <= 15 -> 0; 16 -> (15-16)/5 = -0.2; 18 -> -0.6; 20 -> -1; beyond -> -1
    lengths = torch.tensor([0, 10, 15, 16, 18, 20, 25, 100])
    close(soft_overlong_penalty(lengths, 20, 5), [0.0, 0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0])


def test_soft_overlong_penalty_keeps_shape() -> None:
    out = soft_overlong_penalty(torch.tensor([[12, 19], [8, 30]]), max_length=20, cache_length=10)
    # soft start 10: 12 -> -0.2, 19 -> -0.9, 8 -> 0, 30 -> -1
    close(out, [[-0.2, -0.9], [0.0, -1.0]])


def overlong_batch() -> RolloutBatch:
    # rows: [memory 18 tokens, answer 16 tokens] (trajectory 0), [memory 20, answer 10] (trajectory 1)
    task = Task(question="q", context=["c"], answers=["a"])
    trajectories = [
        Trajectory(task=task, turns=[turn(MEMORY_TURN, 18), turn(ANSWER_TURN, 16)]),
        Trajectory(task=task, turns=[turn(MEMORY_TURN, 20), turn(ANSWER_TURN, 10)]),
    ]
    batch = RolloutBatch.from_trajectories(trajectories, group_size=2, pad_id=0)
    assert batch.response_mask.sum(-1).tolist() == [18, 16, 20, 10]
    assert batch.memory_turns.tolist() == [True, False, True, False]
    return batch


def test_overlong_penalty_answer_turns_only() -> None:
    # L_max 20, L_cache 5: penalties of the rows [-0.6, -0.2, -1, 0]; only answer rows count -> [0, -0.2, 0, 0]
    batch = overlong_batch()
    cb = OverlongPenalty(max_length=20, cache_length=5, turns="answer")
    cb.on_rewards(None, None, batch)  # type: ignore[arg-type]
    close(batch.turn_rewards, [0.0, -0.2, 0.0, 0.0])
    assert cb.penalised_turns == 1


def test_overlong_penalty_all_and_memory_turns_with_weight() -> None:
    batch = overlong_batch()
    cb = OverlongPenalty(max_length=20, cache_length=5, weight=0.5)
    cb.on_rewards(None, None, batch)  # type: ignore[arg-type]
    close(batch.turn_rewards, [-0.3, -0.1, -0.5, 0.0])  # half of [-0.6, -0.2, -1, 0]
    assert cb.penalised_turns == 3

    batch = overlong_batch()
    cb = OverlongPenalty(max_length=20, cache_length=5, turns="memory")
    cb.on_rewards(None, None, batch)  # type: ignore[arg-type]
    close(batch.turn_rewards, [-0.6, 0.0, -1.0, 0.0])
    assert cb.penalised_turns == 2


def test_overlong_penalty_adds_to_existing_turn_rewards_and_counts_over_steps() -> None:
    batch = overlong_batch()
    batch.turn_rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    cb = OverlongPenalty(max_length=20, cache_length=5, turns="answer")
    cb.on_rewards(None, None, batch)  # type: ignore[arg-type]
    close(batch.turn_rewards, [1.0, 0.8, 1.0, 1.0])
    cb.on_rewards(None, None, overlong_batch())  # type: ignore[arg-type]
    assert cb.penalised_turns == 2


def test_overlong_penalty_state_dict_round_trip() -> None:
    cb = OverlongPenalty(max_length=20, cache_length=5, turns="answer")
    cb.on_rewards(None, None, overlong_batch())  # type: ignore[arg-type]
    cb.on_rewards(None, None, overlong_batch())  # type: ignore[arg-type]
    state = cb.state_dict()
    assert state == {"penalised_turns": 2}
    restored = OverlongPenalty(max_length=20, cache_length=5)
    restored.load_state_dict(state)
    assert restored.penalised_turns == 2
    restored.load_state_dict({})
    assert restored.penalised_turns == 0


@pytest.mark.parametrize(
    "kwargs", [{"cache_length": 0}, {"cache_length": 30}, {"cache_length": -1}, {"cache_length": 5, "turns": "x"}]
)
def test_overlong_penalty_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        OverlongPenalty(max_length=20, **kwargs)


# --------------------------------------------------------------------------- memory credit
def test_memory_write_credits() -> None:
    task = Task(question="capital?", context=[], answers=["Paris"])
    traj = Trajectory(
        task=task,
        chunks=["Lyon is big.", "The capital is PARIS.", "Rome too."],
        memories=["nothing yet", "capital: paris!", "lost it"],
    )
    # turn 0: no chunk so far held "paris", memory lacks it -> 0
    # turn 1: chunk holds it, memory holds it (normalised) -> +1
    # turn 2: seen before, memory lost it -> -1
    assert memory_write_credits(traj) == [0.0, 1.0, -1.0]


def test_memory_write_credits_memory_before_evidence_and_any_answer() -> None:
    task = Task(question="q", context=[], answers=["Rome", "the Eternal City"])
    traj = Trajectory(task=task, chunks=["filler", "eternal city"], memories=["guess: rome", "gone"])
    # turn 0: memory holds "rome" though no chunk did -> +1; turn 1: chunk held "eternal city", memory lost it -> -1
    assert memory_write_credits(traj) == [1.0, -1.0]


def test_memory_write_credits_ignores_empty_answers() -> None:
    # "the" normalises to "" and would be "in" every text
    traj = Trajectory(task=Task(question="q", context=[], answers=["the"]), chunks=["x", "y"], memories=["a", "b"])
    assert memory_write_credits(traj) == [0.0, 0.0]


def credit_batch() -> RolloutBatch:
    # trajectory 0 (answer Paris): memory 3 tokens, memory 2 tokens, answer 4 tokens; credits [+1, -1]
    # trajectory 1 (answer Rome):  memory 1 token, answer 2 tokens;                   credits [+1]
    t0 = Trajectory(
        task=Task(question="q0", context=[], answers=["Paris"]),
        turns=[turn(MEMORY_TURN, 3), turn(MEMORY_TURN, 2), turn(ANSWER_TURN, 4)],
        chunks=["Paris is nice", "filler"],
        memories=["Paris", "forgot"],
    )
    t1 = Trajectory(
        task=Task(question="q1", context=[], answers=["Rome"]),
        turns=[turn(MEMORY_TURN, 1), turn(ANSWER_TURN, 2)],
        chunks=["filler"],
        memories=["Rome"],
    )
    batch = RolloutBatch.from_trajectories([t0, t1], group_size=1, pad_id=0)
    # advantage 2 for trajectory 0 and -1 for trajectory 1 on EVERY position, padding too,
    # so that a change on padding would show
    per_turn = torch.tensor([2.0, 2.0, 2.0, -1.0, -1.0])
    batch.advantages = per_turn.unsqueeze(-1).expand(5, 4).clone()
    return batch


def test_memory_token_credit_mixes_only_memory_tokens() -> None:
    batch = credit_batch()
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    module = LogRecorder()
    cb = MemoryTokenCredit(weight=0.25)
    cb.on_advantages(None, module, batch)  # type: ignore[arg-type]
    # memory tokens: 0.75 * A + 0.25 * credit
    #   row 0: 0.75*2 + 0.25*1    = 1.75 on 3 tokens, padding keeps 2
    #   row 1: 0.75*2 + 0.25*(-1) = 1.25 on 2 tokens, padding keeps 2
    #   row 2: answer turn, unchanged 2
    #   row 3: 0.75*(-1) + 0.25*1 = -0.5 on 1 token, padding keeps -1
    #   row 4: answer turn, unchanged -1
    expected = [
        [1.75, 1.75, 1.75, 2.0],
        [1.25, 1.25, 2.0, 2.0],
        [2.0, 2.0, 2.0, 2.0],
        [-0.5, -1.0, -1.0, -1.0],
        [-1.0, -1.0, -1.0, -1.0],
    ]
    close(batch.advantages, expected)
    # credits of the memory turns: [1, -1, 1] -> sum 1, 3 turns, mean 1/3
    assert cb.credit_sum == pytest.approx(1.0)
    assert cb.credited_turns == 3
    assert len(module.calls) == 1
    name, value = module.calls[0]
    assert name == "train/memory_credit"
    assert value == pytest.approx(1 / 3)


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_memory_token_credit_extreme_weights(weight: float) -> None:
    batch = credit_batch()
    before = batch.advantages.clone()
    MemoryTokenCredit(weight=weight).on_advantages(None, LogRecorder(), batch)  # type: ignore[arg-type]
    if weight == 0.0:
        close(batch.advantages, before)
    else:  # memory tokens carry the credit alone
        close(batch.advantages[0, :3], [1.0, 1.0, 1.0])
        close(batch.advantages[1, :2], [-1.0, -1.0])
        close(batch.advantages[3, :1], [1.0])
        close(batch.advantages[2], before[2])
        close(batch.advantages[4], before[4])


def test_memory_token_credit_state_dict_round_trip() -> None:
    cb = MemoryTokenCredit(weight=0.5)
    cb.on_advantages(None, LogRecorder(), credit_batch())  # type: ignore[arg-type]
    cb.on_advantages(None, LogRecorder(), credit_batch())  # type: ignore[arg-type]
    state = cb.state_dict()
    assert state == {"credit_sum": pytest.approx(2.0), "credited_turns": 6}
    restored = MemoryTokenCredit()
    restored.load_state_dict(state)
    assert (restored.credit_sum, restored.credited_turns) == (pytest.approx(2.0), 6)
    restored.load_state_dict({})
    assert (restored.credit_sum, restored.credited_turns) == (0.0, 0)


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_memory_token_credit_bad_weight(weight: float) -> None:
    with pytest.raises(ValueError):
        MemoryTokenCredit(weight=weight)
