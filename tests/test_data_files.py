"""Bad task files stop with one message naming the file, the line and what to fix (not a deep crash)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_memrl.data.files import load_tasks
from lightning_memrl.errors import DataError

GOOD = {"question": "Where is the key?", "context": ["It is in the drawer."], "answers": ["drawer"]}


def _error(path: Path) -> str:
    with pytest.raises(DataError) as info:
        load_tasks(path)
    return str(info.value)


def test_invalid_utf8_names_file_line_and_byte(tmp_path):
    path = tmp_path / "tasks.jsonl"
    bad = json.dumps({**GOOD, "question": "Where is the QUESTION?"}).encode().replace(b"QUESTION", b"cl\xe9")
    path.write_bytes((json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n").encode() + bad + b"\n")
    message = _error(path)
    assert message.startswith(f"{path}: line 3: not valid UTF-8 (byte 0xe9 at byte ")
    assert "Save the file as UTF-8" in message


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD]).encode())
    assert [t.answers for t in load_tasks(path)] == [["drawer"]]


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n" + '{"question": "q?", "context": \n')
    message = _error(path)
    assert message.startswith(f"{path}: line 4: cannot read as jsonl: Expecting value at column 31")
    assert "An error occurred while generating the dataset" not in message


def test_invalid_element_of_a_json_list_names_its_line(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text("[\n  " + json.dumps(GOOD) + ",\n  " + json.dumps(GOOD) + "\n  " + json.dumps(GOOD) + "\n]\n")
    assert _error(path).startswith(f"{path}: line 4: cannot read as json: Expecting ',' delimiter or ']'")


def test_rows_of_a_pretty_printed_json_list_are_named_by_line(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([GOOD, GOOD, {**GOOD, "question": ""}], indent=2))
    message = _error(path)
    first_line_of_row_2 = json.dumps([GOOD, GOOD, {}], indent=2).splitlines().index("  {}") + 1
    assert f"{path}: row 2 (line {first_line_of_row_2}): field 'question' must be a non-empty string" in message


def test_rows_wrapped_in_an_object_say_what_was_found(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"data": [GOOD, GOOD, GOOD]}))
    message = _error(path)
    assert "field 'question' is missing; the row is an object whose 'data' holds a list of 3 objects" in message
    assert "top-level JSON list" in message and "field_map" not in message


def test_missing_field_lists_the_fields_the_row_has(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "q?", "context": "c", "answers": "a"}) + "\n")
    message = _error(path)
    assert "field 'question' is missing; the row has fields ['answers', 'context', 'prompt']" in message
    assert "field_map" in message


@pytest.mark.parametrize(
    ("answers", "found"),
    [
        ("NaN", "got NaN (not a number"),
        ("Infinity", "got Infinity (not a number"),
        ('["a", NaN]', "item 1 is NaN (not a number"),
        ("[true, false]", "item 0 is a boolean (true)"),
        ("false", "got a boolean (false)"),
        ('["a", null]', "item 1 is null"),
        ('[["a"]]', "item 0 is list ['a']"),
    ],
)
def test_answers_that_are_not_text_or_numbers_are_refused(tmp_path, answers, found):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + f'{{"question": "q?", "context": "c", "answers": {answers}}}\n')
    message = _error(path)
    assert f"{path}: row 1 (line 2): field 'answers' must be a string or a non-empty list of strings; {found}" in (
        message
    )
    assert "is missing" not in message


def test_numbers_are_accepted_as_answers_and_written_as_text(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        "".join(json.dumps({**GOOD, "answers": a}) + "\n" for a in (42, 2.5, [1999, "nineteen"], 7.0, -3)),
    )
    assert [t.answers for t in load_tasks(path)] == [["42"], ["2.5"], ["1999", "nineteen"], ["7"], ["-3"]]


def test_json_lines_in_a_json_file_and_one_object(tmp_path):
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "answers": "b"}) + "\n")
    assert [t.answers for t in load_tasks(lines)] == [["drawer"], ["b"]]
    single = tmp_path / "single.json"
    single.write_text(json.dumps(GOOD, indent=2))
    assert [t.id for t in load_tasks(single)] == ["single.json:0"]


def test_a_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(["q?", "c", "a"]) + "\n")
    assert re.match(rf"{re.escape(str(path))}: row 1 \(line 2\): expected an object with fields", _error(path))


def test_nan_in_a_parquet_answer_column_is_refused(tmp_path):
    path = tmp_path / "tasks.parquet"
    pq.write_table(pa.table({"question": ["q?", "q?"], "context": ["c", "c"], "answers": [1.0, float("nan")]}), path)
    message = _error(path)
    assert f"{path}: row 1: field 'answers' must be a string or a non-empty list of strings; got NaN" in message
