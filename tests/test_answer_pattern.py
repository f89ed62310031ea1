"""Answer extraction by a regular expression, in rewards and in validation."""

import pytest
from helpers import answered

from lightning_memrl import MemRLModule
from lightning_memrl.rewards import ExactMatch, SubExactMatch, TokenF1, answer_from_completion

CODE = r"\b\d{4}\b"


def test_pattern_takes_the_first_match() -> None:
    assert answer_from_completion("The secret code of Ana is 4821. Bo has 1234.", CODE) == "4821"
    assert answer_from_completion(r"I think \boxed{code 7004}", CODE) == "7004"  # inside the box when there is one
    assert answer_from_completion("no digits here", CODE) == ""
    assert answer_from_completion("code: 42!", r"code: (\d+)") == "42"  # first group when it has one
    assert answer_from_completion(" 4821 ", None) == "4821"


def test_rewards_score_the_extracted_answer() -> None:
    completion = "The secret code of Ana is 4821."
    assert ExactMatch()(answered(completion, ["4821"])) == 0.0
    assert ExactMatch(answer_pattern=CODE)(answered(completion, ["4821"])) == 1.0
    assert ExactMatch(answer_pattern=CODE)(answered("Ana has 1234, Bo 4821", ["4821"])) == 0.0  # first match only
    assert ExactMatch(require_boxed=True, answer_pattern=CODE)(answered(completion, ["4821"])) == 0.0
    assert SubExactMatch(answer_pattern=CODE)(answered("nothing", ["4821"])) == 0.0
    assert TokenF1(answer_pattern=CODE)(answered(completion, ["4821"])) == 1.0


def test_bad_pattern_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"reward exact_match: answer_pattern: '\(' is not a valid regular expression"):
        ExactMatch(answer_pattern="(")
    with pytest.raises(ValueError, match=r"model.init_args.answer_pattern: '\[' is not a valid"):
        MemRLModule("tiny", answer_pattern="[")
