"""LoCoMo loader: tasks, category-5 exclusion, caps, clear errors, and the data module wiring."""

from __future__ import annotations

import json
import logging

import pytest
from locomo_fixture import locomo_conversation, write_locomo

from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo, normalize_evidence
from lightning_memrl.errors import DataError


def test_questions_become_tasks_and_category_5_is_left_out(tmp_path, caplog):
    path = write_locomo(tmp_path)
    with caplog.at_level(logging.INFO, logger="lightning_memrl.data.locomo"):
        tasks = load_locomo(path)
    assert [t.id for t in tasks] == ["conv-test:qa0", "conv-test:qa1", "conv-test:qa2", "conv-test:qa3"]
    assert [t.answers for t in tasks] == [["Miso"], ["Lisbon"], ["2023"], ["Rosa"]]  # a number becomes text
    assert [t.meta["category"] for t in tasks] == [4, 4, 2, 1]
    assert tasks[3].meta["evidence"] == ["D3:1", "D1:2"]  # "D3:1; D1:2" split
    conversation = tasks[0].meta["conversation"]
    assert [s.name for s in conversation.sessions] == ["session_1", "session_2", "session_3"]
    assert conversation.sessions[1].turns[0].caption == "a broken blue vase"
    assert len(tasks[0].context) == 3  # one transcript per session
    assert tasks[0].context[1] == (
        "session_2 (2:00 pm on 9 May, 2023)\n"
        "[D2:1] Ana: Miso broke a vase. [shares a photo: a broken blue vase]\n"
        "[D2:2] Ben: I moved to Lisbon last week."
    )
    assert "4 questions kept {1: 1, 2: 1, 4: 2}; left out: {'category 5': 1}" in caplog.text


def test_category_5_on_request_gets_the_unanswerable_answer(tmp_path):
    tasks = load_locomo(write_locomo(tmp_path), LoCoMoSettings(categories=[5]))
    assert [(t.question, t.answers) for t in tasks] == [
        ("What did Ben's cat break?", ["Not mentioned in the conversation"])
    ]


def test_session_and_question_caps_are_counted(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_memrl.data.locomo"):
        tasks = load_locomo(write_locomo(tmp_path), LoCoMoSettings(max_sessions=2, max_questions=2))
    assert [t.id for t in tasks] == ["conv-test:qa0", "conv-test:qa1"]
    assert len(tasks[0].meta["conversation"].sessions) == 2
    assert "'evidence after max_sessions': 1" in caplog.text and "'over max_questions': 1" in caplog.text


def test_folder_original_layout_and_conversation_filter(tmp_path):
    write_locomo(tmp_path, "conv-a")
    original = [{"sample_id": "conv-b", "conversation": locomo_conversation(), "qa": locomo_conversation()["qa"]}]
    (tmp_path / "locomo10.json").write_text(json.dumps(original))
    tasks = load_locomo(tmp_path)
    assert sorted({t.meta["conversation_id"] for t in tasks}) == ["conv-a", "conv-b"] and len(tasks) == 8
    only_b = load_locomo(tmp_path, LoCoMoSettings(conversations=["conv-b"]))
    assert {t.meta["conversation_id"] for t in only_b} == {"conv-b"}
    with pytest.raises(DataError, match=r"unknown ids \['conv-z'\]"):
        load_locomo(tmp_path, LoCoMoSettings(conversations=["conv-z"]))


def _broken(mutate) -> dict:
    conversation = locomo_conversation()
    mutate(conversation)
    return conversation


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c["qa"][1].pop("question"), r"conv-test.json: qa\[1\]: field 'question' is missing"),
        (lambda c: c["qa"][0].update(category="4"), r"qa\[0\]: field 'category' must be an integer"),
        (lambda c: c["qa"][2].update(answer=None), r"qa\[2\]: field 'answer' must be a non-empty"),
        (lambda c: c["session_2"][1].pop("dia_id"), r"session_2\[1\]: field 'dia_id' is missing"),
        (lambda c: c.pop("speaker_b"), r"field 'speaker_b' is missing"),
        (lambda c: c.pop("qa"), r"field 'qa' is missing"),
        (lambda c: [c.pop(k) for k in ("session_1", "session_2", "session_3")], r"no session_N fields"),
    ],
)
def test_bad_rows_name_file_item_and_field(tmp_path, mutate, message):
    with pytest.raises(DataError, match=message):
        load_locomo(write_locomo(tmp_path, conversation=_broken(mutate)))


def test_bad_paths(tmp_path):
    with pytest.raises(DataError, match="locomo_path"):
        load_locomo(tmp_path / "missing")
    with pytest.raises(DataError, match=r"no \*.json"):
        load_locomo(tmp_path)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read as JSON"):
        load_locomo(tmp_path / "x.json")
    with pytest.raises(DataError, match="no LoCoMo question left"):
        load_locomo(write_locomo(tmp_path / "ok"), LoCoMoSettings(categories=[3]))


def test_normalize_evidence():
    assert normalize_evidence(["D8:6; D9:17", "D:11:26", "D"]) == ["D8:6", "D9:17", "D11:26", "D"]
    assert normalize_evidence("D1:2") == ["D1:2"]


def test_data_module_reads_locomo_for_both_splits(tmp_path):
    path = write_locomo(tmp_path)
    dm = MemRLDataModule(
        locomo_path=str(path),
        locomo=LoCoMoSettings(categories=[4]),
        locomo_val=LoCoMoSettings(categories=[1, 2]),
        batch_size=2,
    )
    dm.setup("fit")
    assert [t.answers[0] for t in dm.train_tasks] == ["Miso", "Lisbon"]
    assert [t.answers[0] for t in dm.val_tasks] == ["2023", "Rosa"]
    assert next(iter(dm.val_dataloader()))[0].meta["category"] == 2
