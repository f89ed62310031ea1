"""lightning_memrl.data: the synthetic generator, ``load_tasks`` and ``MemRLDataModule``."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import datasets
import jsonargparse
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import lightning_memrl
from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.files import load_tasks
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

QUESTION = re.compile(r"^What is the secret code of (\w+)\?$")


@pytest.fixture(autouse=True)
def _isolated_hf_cache(tmp_path_factory, monkeypatch):
    """Keep the ``datasets`` cache of the files read here out of ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.getbasetemp() / "hf_datasets_cache")


def write_json(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(**overrides):
    return {
        "question": "Where is the key?",
        "context": ["It is in the drawer.", "The drawer is blue."],
        "answers": ["drawer"],
        **overrides,
    }


def _chunk_with(task: Task, sentence: str) -> list[int]:
    return [i for i, chunk in enumerate(task.context) if sentence in chunk]


# --------------------------------------------------------------------------- synthetic tasks
@pytest.mark.parametrize("hops", [1, 2])
def test_synthetic_same_seed_gives_identical_tasks(hops):
    config = SyntheticTaskSettings(num_tasks=25, hops=hops, seed=3, min_chunks=1, max_chunks=4)
    first = generate_synthetic_tasks(config)
    random.seed(12345)  # the global random state must not matter
    second = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=25, hops=hops, seed=3, min_chunks=1, max_chunks=4)
    )
    assert first == second
    assert len(first) == 25


def test_synthetic_different_seed_gives_different_tasks():
    a = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=20, seed=0))
    b = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=20, seed=1))
    assert [t.context for t in a] != [t.context for t in b]
    assert [(t.question, t.answers) for t in a] != [(t.question, t.answers) for t in b]
    assert not {t.id for t in a} & {t.id for t in b}


def test_synthetic_ids_and_answers():
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=10, seed=7))
    assert [t.id for t in tasks] == [f"synthetic-7-{i}" for i in range(10)]
    for task in tasks:
        assert QUESTION.match(task.question)
        assert isinstance(task.context, list) and all(isinstance(c, str) and c for c in task.context)
        assert len(task.answers) == 1 and re.fullmatch(r"\d{4}", task.answers[0])


def test_synthetic_zero_tasks():
    assert generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=0)) == []


@pytest.mark.parametrize(("min_chunks", "max_chunks"), [(1, 1), (3, 3), (2, 5), (1, 6)])
def test_synthetic_respects_min_and_max_chunks(min_chunks, max_chunks):
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=200, min_chunks=min_chunks, max_chunks=max_chunks))
    counts = [len(t.context) for t in tasks]
    assert all(min_chunks <= n <= max_chunks for n in counts)
    assert min(counts) == min_chunks and max(counts) == max_chunks  # both ends are drawn
    assert all(t.meta["num_chunks"] == len(t.context) for t in tasks)


@pytest.mark.parametrize(("hops", "distractors", "per_chunk"), [(1, 0, 1), (1, 3, 2), (2, 2, 3), (2, 0, 0)])
def test_synthetic_sentence_budget(hops, distractors, per_chunk):
    """Every chunk holds ``sentences_per_chunk`` filler sentences plus the facts put into it."""
    config = SyntheticTaskSettings(num_tasks=30, hops=hops, distractor_facts=distractors, sentences_per_chunk=per_chunk)
    for task in generate_synthetic_tasks(config):
        sentences = sum(chunk.count(".") for chunk in task.context)
        assert sentences == len(task.context) * per_chunk + hops + distractors
        assert " ".join(task.context).count("The secret code of ") == 1 + distractors


@pytest.mark.parametrize("distractors", [0, 2, 5])
def test_synthetic_one_hop_answer_is_stated_in_the_context(distractors):
    tasks = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=60, hops=1, distractor_facts=distractors, max_chunks=5, seed=11)
    )
    for task in tasks:
        target = QUESTION.match(task.question).group(1)
        (code,) = task.answers
        holding = _chunk_with(task, f"The secret code of {target} is {code}.")
        assert len(holding) == 1, task
        assert task.meta["evidence_chunks"] == holding
        assert "uses the same secret code as" not in " ".join(task.context)


@pytest.mark.parametrize("distractors", [0, 3])
def test_synthetic_two_hop_facts_are_present(distractors):
    tasks = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=60, hops=2, distractor_facts=distractors, max_chunks=5, seed=5)
    )
    for task in tasks:
        target = QUESTION.match(task.question).group(1)
        (code,) = task.answers
        text = " ".join(task.context)
        bridge = re.findall(rf"{target} uses the same secret code as (\w+)\.", text)
        assert len(bridge) == 1, task
        (other,) = bridge
        assert other != target
        bridge_chunks = _chunk_with(task, f"{target} uses the same secret code as {other}.")
        code_chunks = _chunk_with(task, f"The secret code of {other} is {code}.")
        assert len(bridge_chunks) == 1 and len(code_chunks) == 1, task
        # the asked person's code is never stated: it takes both hops
        assert f"The secret code of {target} is" not in text
        # one entry per evidence fact (bridge, then code fact), sorted; both may sit in one chunk
        assert task.meta["evidence_chunks"] == sorted(bridge_chunks + code_chunks)
        assert all(0 <= c < task.meta["num_chunks"] for c in task.meta["evidence_chunks"])


def test_synthetic_distractors_are_about_other_people():
    for task in generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=40, hops=1, distractor_facts=6)):
        target = QUESTION.match(task.question).group(1)
        people = re.findall(r"The secret code of (\w+) is \d{4}\.", " ".join(task.context))
        assert len(people) == 7 and len(set(people)) == 7
        assert people.count(target) == 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"min_chunks": 0}, "min_chunks"),
        ({"min_chunks": -1, "max_chunks": 2}, "min_chunks"),
        ({"min_chunks": 4, "max_chunks": 3}, "max_chunks"),
        ({"hops": 0}, "hops"),
        ({"hops": 3}, "hops"),
        ({"hops": 1, "distractor_facts": 26}, "distractor_facts"),
        ({"hops": 2, "distractor_facts": 25}, "distractor_facts"),
    ],
)
def test_synthetic_bad_knobs_raise_data_error(knobs, message):
    with pytest.raises(DataError, match=message):
        generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, **knobs))


@pytest.mark.parametrize(("hops", "distractors"), [(1, 25), (2, 24)])
def test_synthetic_largest_distractor_count_is_allowed(hops, distractors):
    (task,) = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, hops=hops, distractor_facts=distractors))
    assert " ".join(task.context).count("The secret code of ") == 1 + distractors


@pytest.mark.parametrize(
    "knobs", [{"distractor_facts": -1}, {"hops": 2, "distractor_facts": -2}, {"sentences_per_chunk": -1}]
)
def test_synthetic_negative_knobs_raise_data_error(knobs):
    with pytest.raises(DataError):
        generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, **knobs))


# --------------------------------------------------------------------------- load_tasks: reading
def test_load_json_list_of_objects(tmp_path):
    path = write_json(
        tmp_path / "tasks.json",
        [
            row(id="first"),
            row(question="Who?", context="One long text to cut into chunks.", answers="Ann"),
            row(question="How many?", answers=3),
        ],
    )
    tasks = load_tasks(path)
    assert [type(t) for t in tasks] == [Task] * 3
    assert tasks[0] == Task(
        question="Where is the key?",
        context=["It is in the drawer.", "The drawer is blue."],
        answers=["drawer"],
        id="first",
    )
    assert tasks[1].context == "One long text to cut into chunks."  # a string stays one text
    assert tasks[1].answers == ["Ann"]
    assert tasks[2].answers == ["3"]


def test_load_jsonl(tmp_path):
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            row(),
            row(context="A single context string."),
            row(answers=[7, "seven"]),
            row(answers=2.5),
        ],
    )
    tasks = load_tasks(str(path))  # a str path works too
    assert len(tasks) == 4
    assert tasks[0].context == ["It is in the drawer.", "The drawer is blue."]
    assert tasks[1].context == "A single context string."
    assert tasks[2].answers == ["7", "seven"]
    assert tasks[3].answers == ["2.5"]
    assert [t.id for t in tasks] == [f"tasks.jsonl:{i}" for i in range(4)]  # default ids: file name and row


def test_load_jsonl_suffix_is_case_insensitive(tmp_path):
    (task,) = load_tasks(write_jsonl(tmp_path / "TASKS.JSONL", [row()]))
    assert task.answers == ["drawer"]


def test_load_parquet_written_with_pyarrow(tmp_path):
    path = tmp_path / "tasks.parquet"
    table = pa.table(
        {
            "question": ["q1?", "q2?"],
            "context": [["chunk a", "chunk b"], ["chunk c"]],
            "answers": [["x"], ["y", "z"]],
            "id": [10, 11],
        }
    )
    pq.write_table(table, path)
    tasks = load_tasks(path)
    assert tasks == [
        Task(question="q1?", context=["chunk a", "chunk b"], answers=["x"], id="10"),
        Task(question="q2?", context=["chunk c"], answers=["y", "z"], id="11"),
    ]


def test_load_parquet_written_with_datasets(tmp_path):
    path = tmp_path / "tasks.parquet"
    datasets.Dataset.from_list(
        [
            {"question": "Year?", "context": "It happened in 1999.", "answers": 1999},
            {"question": "Year again?", "context": "Then 2001 came.", "answers": 2001},
        ]
    ).to_parquet(str(path))
    tasks = load_tasks(path)
    assert [t.answers for t in tasks] == [["1999"], ["2001"]]
    assert [t.context for t in tasks] == ["It happened in 1999.", "Then 2001 came."]
    assert [t.id for t in tasks] == ["tasks.parquet:0", "tasks.parquet:1"]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_load_with_field_map(tmp_path, suffix):
    rows = [
        {"prompt": "Colour?", "passages": ["The sky is grey."], "gold": "grey", "uid": "u1", "question": "ignored"},
        {
            "prompt": "Size?",
            "passages": ["It is big.", "Very big."],
            "gold": ["big", "large"],
            "uid": "u2",
            "question": "ignored",
        },
    ]
    path = tmp_path / f"mapped{suffix}"
    if suffix == ".json":
        write_json(path, rows)
    elif suffix == ".jsonl":
        write_jsonl(path, rows)
    else:
        datasets.Dataset.from_list(
            [{**r, "gold": [r["gold"]] if isinstance(r["gold"], str) else r["gold"]} for r in rows]
        ).to_parquet(str(path))
    field_map = {"question": "prompt", "context": "passages", "answers": "gold", "id": "uid"}
    tasks = load_tasks(path, field_map=field_map)
    assert [(t.question, t.context, t.answers, t.id) for t in tasks] == [
        ("Colour?", ["The sky is grey."], ["grey"], "u1"),
        ("Size?", ["It is big.", "Very big."], ["big", "large"], "u2"),
    ]


def test_partial_field_map_keeps_default_names(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [{"q": "Why?", "context": "Because.", "answers": "because"}])
    (task,) = load_tasks(path, field_map={"question": "q"})
    assert (task.question, task.context, task.answers) == ("Why?", "Because.", ["because"])


def test_integer_answers_stay_integers_next_to_float_answers(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [row(answers=42), row(answers=3.5)])
    assert [t.answers for t in load_tasks(path)] == [["42"], ["3.5"]]


def test_rows_without_id_get_default_id_when_others_have_one(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [row(id="a"), row(), row()])
    assert [t.id for t in load_tasks(path)] == ["a", "tasks.jsonl:1", "tasks.jsonl:2"]


# --------------------------------------------------------------------------- load_tasks: bad rows
def _row_error(path: Path, rows: list[dict], field_map: dict[str, str] | None = None) -> str:
    if path.suffix == ".json":
        write_json(path, rows)
    else:
        write_jsonl(path, rows)
    with pytest.raises(DataError) as info:
        load_tasks(path, field_map=field_map)
    return str(info.value)


def _assert_names(message: str, path: Path, row_number: int, field_name: str) -> None:
    assert str(path) in message
    assert re.search(rf": row {row_number}( \(line \d+\))?: ", message)  # rows are counted from 0 in file order
    assert f"field '{field_name}'" in message


@pytest.mark.parametrize("missing", ["question", "context", "answers"])
def test_missing_field_names_file_row_and_field(tmp_path, missing):
    bad = row()
    del bad[missing]
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row(), bad])
    _assert_names(message, path, 1, missing)
    assert "is missing" in message
    assert "field_map" in message  # points at the way to map another column name


def test_null_field_counts_as_missing(tmp_path):
    path = tmp_path / "tasks.json"
    message = _row_error(path, [row(), row(), row(answers=None)])
    _assert_names(message, path, 2, "answers")
    assert "is missing" in message


def test_missing_mapped_column_names_the_mapped_column(tmp_path):
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row()], field_map={"question": "prompt"})
    _assert_names(message, path, 0, "prompt")
    assert "is missing" in message
    assert "'question'" in message  # and the key to map


@pytest.mark.parametrize("question", ["", "   ", 17])
def test_empty_or_non_string_question(tmp_path, question):
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row(question=question)])
    _assert_names(message, path, 0, "question")
    assert "non-empty string" in message


def test_empty_question_in_a_later_row(tmp_path):
    path = tmp_path / "tasks.json"
    message = _row_error(path, [row(), row(), row(), row(question=" \n")])
    _assert_names(message, path, 3, "question")


@pytest.mark.parametrize(
    ("context", "problem"),
    [
        (5, "must be a string or a non-empty list of strings"),
        ([1, 2], "must be a string or a non-empty list of strings"),
        ([], "must be a string or a non-empty list of strings"),
        ({"text": "a dict"}, "must be a string or a non-empty list of strings"),
        ("", "is empty"),
        ("   ", "is empty"),
        (["", "  "], "has only empty chunks"),
    ],
)
def test_bad_context(tmp_path, context, problem):
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row(context=context)])
    _assert_names(message, path, 0, "context")
    assert problem in message


@pytest.mark.parametrize(
    ("answers", "problem"),
    [
        ([], "must be a string or a non-empty list of strings"),
        (True, "must be a string or a non-empty list of strings"),
        ({"a": 1}, "must be a string or a non-empty list of strings"),
        ("", "has only empty answers"),
        (["", " "], "has only empty answers"),
    ],
)
def test_bad_answers(tmp_path, answers, problem):
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row(answers=answers)])
    _assert_names(message, path, 0, "answers")
    assert problem in message


def test_empty_answers_list_in_a_later_row(tmp_path):
    path = tmp_path / "tasks.jsonl"
    message = _row_error(path, [row(), row(answers=[])])
    _assert_names(message, path, 1, "answers")


def test_bad_row_in_parquet(tmp_path):
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"question": ["ok?", "   "], "context": ["c", "c"], "answers": [["a"], ["b"]]}), path)
    with pytest.raises(DataError) as info:
        load_tasks(path)
    _assert_names(str(info.value), path, 1, "question")


# --------------------------------------------------------------------------- load_tasks: bad files
def test_unknown_field_map_key(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", [row()])
    with pytest.raises(DataError, match=r"field_map: unknown keys \['bogus'\]") as info:
        load_tasks(path, field_map={"bogus": "x", "question": "question"})
    for allowed in ("answers", "context", "id", "question"):
        assert allowed in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "tasks.jsonl"
    with pytest.raises(DataError, match="no such file") as info:
        load_tasks(path)
    assert str(path) in str(info.value)


def test_directory_is_not_a_file(tmp_path):
    path = tmp_path / "folder.json"
    path.mkdir()
    with pytest.raises(DataError, match="no such file") as info:
        load_tasks(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name", ["tasks.csv", "tasks.txt", "tasks"])
def test_unsupported_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text("question,context,answers\nq,c,a\n")
    with pytest.raises(DataError, match="unsupported extension") as info:
        load_tasks(path)
    assert str(path) in str(info.value)
    assert ".json" in str(info.value) and ".parquet" in str(info.value)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("tasks.json", '[{"question": "q", "context": '),
        ("tasks.jsonl", '{"question": "q", "context": "c", "answers": ["a"]}\n{"question": \n'),
        ("tasks.parquet", b"PAR1 this is not really parquet"),
    ],
)
def test_corrupt_file(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DataError) as info:
        load_tasks(path)
    message = str(info.value)
    assert str(path) in message
    assert f"cannot read as {path.suffix[1:]}" in message
    assert info.value.__cause__ is not None  # the reader's own error is chained


def _write_empty(path: Path, kind: str) -> None:
    if kind == "zero bytes":
        path.write_bytes(b"")
    elif kind == "blank lines":
        path.write_text("\n\n")
    elif kind == "empty list":
        path.write_text("[]")
    else:  # a Parquet file with columns and no rows
        schema = {
            "question": pa.array([], pa.string()),
            "context": pa.array([], pa.string()),
            "answers": pa.array([], pa.list_(pa.string())),
        }
        pq.write_table(pa.table(schema), path)


EMPTY_FILES = [
    ("tasks.json", "zero bytes"),
    ("tasks.jsonl", "zero bytes"),
    ("tasks.jsonl", "blank lines"),
    ("tasks.json", "empty list"),
    ("tasks.parquet", "zero bytes"),
    ("tasks.parquet", "no rows"),
]


@pytest.mark.parametrize(("name", "kind"), EMPTY_FILES)
def test_empty_file(tmp_path, name, kind):
    path = tmp_path / name
    _write_empty(path, kind)
    with pytest.raises(DataError) as info:
        load_tasks(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("name", "kind"), [("tasks.jsonl", "zero bytes"), ("tasks.json", "empty list"), ("tasks.parquet", "no rows")]
)
def test_empty_file_is_reported_as_empty(tmp_path, name, kind):
    path = tmp_path / name
    _write_empty(path, kind)
    with pytest.raises(DataError, match="no rows"):
        load_tasks(path)


# --------------------------------------------------------------------------- MemRLDataModule
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


def test_synthetic_settings_keep_their_yaml_keys():
    """``data.init_args.synthetic`` / ``synthetic_val`` of a config become :class:`SyntheticTaskSettings`."""
    assert "SyntheticTaskSettings" in lightning_memrl.__all__ and not hasattr(lightning_memrl, "SyntheticTaskConfig")
    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "memagent" / "tiny.yaml").read_text())["data"][
        "init_args"
    ]
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(MemRLDataModule, "data")
    dm = parser.instantiate_classes(parser.parse_object({"data": config})).data
    assert dm.synthetic == SyntheticTaskSettings(32, 2, 3, 1, 1, 1, 0)
    assert dm.synthetic_val == SyntheticTaskSettings(8, 2, 3, 1, 1, 1, 1000)
