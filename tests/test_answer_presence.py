"""The gold-answer checks the credit methods share."""

from __future__ import annotations

import pytest

from lightning_memrl.credit.answer_presence import answer_word_recall, holds_answer


def test_holds_answer_matches_whole_normalised_words():
    assert holds_answer("The code is 4417.", ["4417"])
    assert not holds_answer("The code is 44170.", ["4417"])
    assert holds_answer("we met in NEW YORK, sadly", ["Paris", "new york"])
    assert not holds_answer("anything", ["", "the"])  # an answer that normalises to nothing never matches


def test_answer_word_recall_is_the_best_answers_word_fraction():
    assert answer_word_recall("Alice lives in Lisbon", ["Lisbon, Portugal"]) == pytest.approx(1 / 2)
    assert answer_word_recall("Alice lives in Lisbon Portugal", ["Lisbon, Portugal", "x"]) == pytest.approx(1.0)
    assert answer_word_recall("nothing here", ["Lisbon Portugal", "blue car"]) == 0.0
    assert answer_word_recall("the", ["the"]) == 0.0  # articles are dropped: no word left to find
