"""lightning_memrl.data.files: ``load_tasks`` (formats, field maps, row and file errors)."""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from task_files import isolated_hf_cache, row, write_json, write_jsonl  # noqa: F401 (autouse fixture)

from lightning_memrl.data.files import load_tasks
from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

QUESTION = re.compile(r"^What is the secret code of (\w+)\?$")


def _chunk_with(task: Task, sentence: str) -> list[int]:
    return [i for i, chunk in enumerate(task.context) if sentence in chunk]


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
