"""lightning_memrl.data.datamodule: ``MemRLDataModule`` from synthetic settings and from task files."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from task_files import isolated_hf_cache, row, write_json, write_jsonl  # noqa: F401 (autouse fixture)

from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import DataError
from lightning_memrl.types import Task


def test_datamodule_synthetic_defaults():
    dm = MemRLDataModule()
    dm.setup("fit")
    assert len(dm.train_tasks) == SyntheticTaskSettings().num_tasks == 64
    assert len(dm.val_tasks) == 16
    assert dm.train_tasks == generate_synthetic_tasks(SyntheticTaskSettings())
    assert dm.val_tasks == generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=16, seed=1000))
    train = {(t.question, tuple(t.context)) for t in dm.train_tasks}
    assert not train & {(t.question, tuple(t.context)) for t in dm.val_tasks}


def test_datamodule_validation_seed_follows_training_seed():
    dm = MemRLDataModule(synthetic=SyntheticTaskSettings(num_tasks=4, seed=5))
    dm.setup()
    assert {t.id.rsplit("-", 1)[0] for t in dm.val_tasks} == {"synthetic-1005"}


def test_datamodule_setup_loads_once():
    dm = MemRLDataModule(synthetic=SyntheticTaskSettings(num_tasks=4))
    dm.setup("fit")
    train, val = dm.train_tasks, dm.val_tasks
    dm.setup("validate")
    assert dm.train_tasks is train and dm.val_tasks is val


def test_datamodule_from_files_with_field_map(tmp_path):
    train_rows = [{"q": f"Q{i}?", "ctx": [f"chunk {i}"], "a": str(i)} for i in range(5)]
    train = write_jsonl(tmp_path / "train.jsonl", train_rows)
    val = tmp_path / "val.parquet"
    pq.write_table(pa.table({"q": ["V?"], "ctx": ["one text"], "a": [["v"]]}), val)
    dm = MemRLDataModule(
        train_path=str(train), val_path=str(val), field_map={"question": "q", "context": "ctx", "answers": "a"}
    )
    dm.setup("fit")
    assert [t.question for t in dm.train_tasks] == [f"Q{i}?" for i in range(5)]
    assert [t.answers for t in dm.train_tasks] == [[str(i)] for i in range(5)]
    assert dm.val_tasks == [Task(question="V?", context="one text", answers=["v"], id="val.parquet:0")]


def test_datamodule_train_file_with_synthetic_validation(tmp_path):
    train = write_json(tmp_path / "train.json", [row(), row()])
    dm = MemRLDataModule(train_path=str(train), synthetic_val=SyntheticTaskSettings(num_tasks=3, seed=9))
    dm.setup()
    assert len(dm.train_tasks) == 2 and dm.train_tasks[0].id == "train.json:0"
    assert [t.id for t in dm.val_tasks] == [f"synthetic-9-{i}" for i in range(3)]


def test_datamodule_bad_file_stops_setup(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [row(), row(answers=[])])
    dm = MemRLDataModule(train_path=str(train))
    with pytest.raises(DataError, match=r"row 1 \(line 2\): field 'answers'"):
        dm.setup("fit")


def test_train_dataloader_yields_lists_of_tasks(tmp_path):
    dm = MemRLDataModule(batch_size=3, synthetic=SyntheticTaskSettings(num_tasks=8, seed=2), seed=4)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 2  # 8 tasks, batches of 3, the last partial batch is dropped
    for batch in batches:
        assert isinstance(batch, list) and len(batch) == 3
        assert all(isinstance(task, Task) for task in batch)
    ids = [t.id for b in batches for t in b]
    assert len(set(ids)) == 6 and set(ids) <= {t.id for t in dm.train_tasks}
    # shuffled, and the same order from a fresh loader with the same seed
    assert [t.id for b in dm.train_dataloader() for t in b] == ids
    assert ids != [t.id for t in dm.train_tasks[:6]]


def test_train_dataloader_shuffle_depends_on_seed():
    orders = []
    for seed in (0, 1):
        dm = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=16), seed=seed)
        dm.setup()
        orders.append([t.id for b in dm.train_dataloader() for t in b])
    assert sorted(orders[0]) == sorted(orders[1])
    assert orders[0] != orders[1]


def test_val_dataloader_keeps_order_and_last_batch():
    dm = MemRLDataModule(val_batch_size=4, synthetic_val=SyntheticTaskSettings(num_tasks=6, seed=3))
    dm.setup("validate")
    batches = list(dm.val_dataloader())
    assert [len(b) for b in batches] == [4, 2]
    assert all(isinstance(t, Task) for b in batches for t in b)
    assert [t.id for b in batches for t in b] == [t.id for t in dm.val_tasks]
    assert [len(b) for b in dm.test_dataloader()] == [4, 2]
