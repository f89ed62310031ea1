"""Held-apart validation: LoCoMo split by conversation, and no task in both splits whatever the source."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from locomo_fixture import locomo_conversation, write_locomo

from lightning_memrl import MemRLDataModule, SyntheticTaskSettings
from lightning_memrl.data.locomo import LoCoMoSettings
from lightning_memrl.errors import ConfigError, DataError


def _five_conversations(folder):
    """conv-1 .. conv-5: the fixture with its speaker renamed, so contexts and questions differ."""
    for i, name in enumerate(["Ana", "Bea", "Cid", "Dov", "Eli"], start=1):
        write_locomo(folder, f"conv-{i}", json.loads(json.dumps(locomo_conversation()).replace("Ana", name)))
    return folder


def _conversations(tasks):
    return sorted({t.meta["conversation_id"] for t in tasks})


def test_locomo_split_trains_on_four_and_validates_on_the_fifth(tmp_path, caplog):
    dm = MemRLDataModule(
        locomo_path=str(_five_conversations(tmp_path / "data")),
        locomo=LoCoMoSettings(categories=[4]),  # 2 questions per conversation
        locomo_val=LoCoMoSettings(categories=[1, 2, 4]),  # 4 per conversation
        locomo_val_conversations=1,
    )
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    assert _conversations(dm.train_tasks) == ["conv-1", "conv-2", "conv-3", "conv-4"]
    assert _conversations(dm.val_tasks) == ["conv-5"]
    assert (len(dm.train_tasks), len(dm.val_tasks)) == (8, 4)  # the validation filters apply to conv-5
    expected = (
        "train on 4 conversations ['conv-1', 'conv-2', 'conv-3', 'conv-4'] (8 questions), validate on 1 ['conv-5']"
    )
    assert expected in caplog.text  # logged on the console
    two = MemRLDataModule(locomo_path=str(tmp_path / "data"), locomo_val_conversations=2)
    two.setup("validate")  # validate/test evaluate the same held-out conversations as fit
    assert _conversations(two.val_tasks) == ["conv-4", "conv-5"] and len(two.train_tasks) == 12


def test_locomo_split_needs_enough_conversations_and_one_way_to_choose_them(tmp_path):
    one = write_locomo(tmp_path / "one")
    with pytest.raises(DataError, match=r"locomo_val_conversations=1 needs at least 2 conversations.*\['conv-test'\]"):
        MemRLDataModule(locomo_path=str(one), locomo_val_conversations=1).setup("fit")
    both = MemRLDataModule(
        locomo_path=str(one), locomo_val=LoCoMoSettings(conversations=["conv-test"]), locomo_val_conversations=1
    )
    with pytest.raises(DataError, match="set one"):
        both.setup("fit")
    with pytest.raises(ConfigError, match="locomo_val_conversations must be >= 0"):
        MemRLDataModule(locomo_path=str(one), locomo_val_conversations=-1)
    with pytest.raises(ConfigError, match="unset train_path and val_path"):
        MemRLDataModule(locomo_path=str(one), val_path="dev.jsonl", locomo_val_conversations=1)


def test_locomo_validating_on_the_training_questions_is_refused(tmp_path):
    dm = MemRLDataModule(locomo_path=str(_five_conversations(tmp_path / "data")))  # locomo_val = locomo
    with pytest.raises(DataError) as err:
        dm.setup("fit")
    message = str(err.value)
    assert "20 of 20 validation tasks are training tasks" in message
    assert "e.g. 'conv-1:qa0', 'conv-1:qa1', 'conv-1:qa2', 'conv-1:qa3', 'conv-2:qa0';" in message
    assert "locomo_val_conversations" in message


def test_overlap_is_refused_for_synthetic_and_file_tasks(tmp_path):
    same_seed = MemRLDataModule(
        synthetic=SyntheticTaskSettings(num_tasks=4), synthetic_val=SyntheticTaskSettings(num_tasks=2)
    )
    with pytest.raises(DataError, match=r"2 of 2 validation tasks .* 'synthetic-0-0', 'synthetic-0-1'"):
        same_seed.setup("fit")
    rows = [{"question": f"Q{i}?", "context": [f"chunk {i}"], "answers": [str(i)]} for i in range(3)]
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dev.write_text(
        "".join(json.dumps(r) + "\n" for r in [{"question": "New?", "context": "x", "answers": "y"}, rows[2]])
    )
    files = MemRLDataModule(train_path=str(train), val_path=str(dev))
    with pytest.raises(DataError, match=r"1 of 2 validation tasks .* 'train.jsonl:2' \(validation 'dev.jsonl:1'\)"):
        files.setup("fit")
    files.setup("validate")  # evaluating a checkpoint: there is no training split to overlap


def test_overlap_check_is_skipped_when_the_fit_never_validates(tmp_path):
    dm = MemRLDataModule(synthetic=SyntheticTaskSettings(num_tasks=4), synthetic_val=SyntheticTaskSettings(num_tasks=2))
    dm.trainer = SimpleNamespace(limit_val_batches=0)
    dm.setup("fit")
    assert len(dm.val_tasks) == 2


def test_same_conversation_different_questions_is_allowed_with_a_warning(tmp_path, caplog):
    dm = MemRLDataModule(
        locomo_path=str(write_locomo(tmp_path)),
        locomo=LoCoMoSettings(categories=[4]),
        locomo_val=LoCoMoSettings(categories=[1, 2]),
    )
    with caplog.at_level(logging.WARNING, logger="lightning_memrl.data.splits"):
        dm.setup("fit")
    assert "different questions of the same 1 LoCoMo conversations ['conv-test']" in caplog.text
