"""Raw rows of a task file: JSON and JSON Lines read line by line, Parquet through ``pyarrow``.

JSON is decoded here (strict UTF-8, the ``json`` module) rather than through ``datasets`` so that
an error names the file and the line: an invalid byte, a line that is not JSON, a line that is not
an object. Every row comes back with the line it starts on, which the row checks then name too.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from pathlib import Path
from typing import Any

from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

Row = tuple[Any, int | None]  # a raw row and the line it starts on (None: not a text file)


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # what JSON counts as whitespace


def _decode(path: Path, data: bytes) -> str:
    """The file's text; invalid UTF-8 raises a DataError naming the line and the byte."""
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = start + err.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
        raise DataError(
            f"{path}: line {line}: not valid UTF-8 (byte 0x{data[offset]:02x} at byte {column} of the line: "
            f"{err.reason}). Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`."
        ) from err


def _json_lines(path: Path, text: str, kind: str) -> list[Row]:
    """One JSON value per non-blank line."""
    rows: list[Row] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((json.loads(line), number))
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}: line {number}: cannot read as {kind}: {err.msg} at column {err.colno}. "
                "Each line must hold one whole JSON object (a task)."
            ) from err
    return rows


def _json_array(path: Path, text: str, start: int) -> list[Row]:
    """The elements of the top-level JSON list that opens at ``start``, each with the line it starts on."""
    decoder, rows = json.JSONDecoder(), []
    line, counted = 1, 0
    pos = _WHITESPACE.match(text, start + 1).end()
    try:
        if text.startswith("]", pos):  # an empty list
            pos += 1
        else:
            while True:
                value, end = decoder.raw_decode(text, pos)
                line, counted = line + text.count("\n", counted, pos), pos
                rows.append((value, line))
                pos = _WHITESPACE.match(text, end).end()
                if text.startswith("]", pos):
                    pos += 1
                    break
                if not text.startswith(",", pos):
                    raise json.JSONDecodeError("Expecting ',' delimiter or ']'", text, pos)
                pos = _WHITESPACE.match(text, pos + 1).end()
        pos = _WHITESPACE.match(text, pos).end()
        if pos < len(text):
            raise json.JSONDecodeError("Extra data after the list", text, pos)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}: line {err.lineno}: cannot read as json: {err.msg} at column {err.colno}. "
            "A .json file holds one list of task objects ([{...}, {...}])."
        ) from err
    return rows


def read_json_rows(path: Path) -> list[Row]:
    """Rows of a ``.json`` file (a list of objects, one object, or JSON Lines) or a ``.jsonl`` file.

    Raises:
        DataError: invalid UTF-8 or invalid JSON, naming the line.
    """
    text = _decode(path, path.read_bytes())
    if path.suffix.lower() == ".jsonl":
        return _json_lines(path, text, "jsonl")
    start = _WHITESPACE.match(text).end()
    if text.startswith("[", start):
        return _json_array(path, text, start)
    try:
        return [(json.loads(text), text.count("\n", 0, start) + 1)] if text.strip() else []
    except json.JSONDecodeError as err:
        if err.msg != "Extra data":
            raise DataError(
                f"{path}: line {err.lineno}: cannot read as json: {err.msg} at column {err.colno}."
            ) from err
    return _json_lines(path, text, "json")  # several objects: JSON Lines in a .json file


def read_parquet_rows(path: Path) -> list[Row]:
    """Rows of a Parquet file as Python dicts (no line numbers).

    Raises:
        DataError: the file is not readable Parquet.
    """
    import pyarrow.parquet as pq

    try:
        return [(row, None) for row in pq.read_table(path).to_pylist()]
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: cannot read as parquet: {err}") from err


# --------------------------------------------------------------------------- files
def _found_instead(row: dict[str, Any]) -> tuple[str, str | None]:
    """What a row without a required field holds instead, and the fix when it is not a column name."""
    wrapped = [k for k, v in row.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    if wrapped:
        return (
            f"; the row is an object whose '{wrapped[0]}' holds a list of {len(row[wrapped[0]])} objects",
            "Write the tasks themselves as the rows: a top-level JSON list ([{...}, {...}]) or one object per "
            "line in a .jsonl file.",
        )
    return f"; the row has fields {sorted(row)[:20]}", None


def _answer_strings(answers: Any) -> tuple[list[str], str]:
    """Gold answers as strings, or ``[]`` and what is wrong; finite numbers count (42 -> "42")."""
    texts = []
    for i, answer in enumerate(answers if isinstance(answers, list) else [answers]):
        got = f"item {i} is" if isinstance(answers, list) else "got"
        if isinstance(answer, bool):
            return [], f'{got} a boolean ({json.dumps(answer)}): write the answer as text, e.g. "yes"'
        if isinstance(answer, float) and not math.isfinite(answer):
            return [], f"{got} {json.dumps(answer)} (not a number, or an empty numeric cell): write the answer as text"
        if isinstance(answer, float):  # a Parquet column mixing ints and floats is read as float: 42.0 -> "42"
            texts.append(str(int(answer)) if answer.is_integer() else str(answer))
        elif isinstance(answer, (str, int)):
            texts.append(str(answer))
        else:
            return [], f"{got} {'null' if answer is None else f'{type(answer).__name__} {answer!r:.40}'}"
    return texts, "" if texts else "got an empty list"


def _check_row(
    row: Any, index: int, source: str, fields: dict[str, str], line: int | None = None, require_answers: bool = True
) -> Task:
    """Turn one raw row into a Task or raise an error naming the file, row (and line) and field.

    Without ``require_answers`` a row may leave ``answers`` out (or null, or ``[]``): its task has none.
    """
    where = f"{source}: row {index}" + (f" (line {line})" if line is not None else "")

    def fail(key: str, problem: str, fix: str | None = None) -> DataError:
        fix = fix or f"Fix the row, or map the field with --data.init_args.field_map (e.g. {{'{key}': 'your_column'}})."
        return DataError(f"{where}: field '{fields[key]}' {problem}. {fix}")

    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected an object with fields {[fields[k] for k in ('question', 'context', 'answers')]}, "
            f"got a {type(row).__name__} {row!r:.60}"
        )
    optional = () if require_answers else ("answers",)
    for key in ("question", "context", "answers"):
        if key in optional and row.get(fields[key]) is None:
            continue
        if fields[key] not in row:
            raise fail(key, "is missing" + _found_instead(row)[0], _found_instead(row)[1])
        if row[fields[key]] is None:
            raise fail(key, "is missing (null)")
    question, context, answers = (row.get(fields[k]) for k in ("question", "context", "answers"))
    if not isinstance(question, str) or not question.strip():
        raise fail("question", f"must be a non-empty string, got {type(question).__name__} {question!r:.40}")
    if isinstance(context, str):
        if not context.strip():
            raise fail("context", "is empty")
    elif isinstance(context, list) and context and all(isinstance(c, str) for c in context):
        if not any(c.strip() for c in context):
            raise fail("context", "has only empty chunks")
    else:
        raise fail("context", "must be a string or a non-empty list of strings")
    given = answers is not None and (require_answers or answers != [])  # optional answers may be [] too
    answers, problem = _answer_strings(answers) if given else ([], "")
    if problem:
        raise fail("answers", f"must be a string or a non-empty list of strings; {problem}", "Fix the row.")
    if answers and not any(a.strip() for a in answers):
        raise fail("answers", "has only empty answers")
    raw_id = row.get(fields["id"])
    task_id = str(raw_id) if raw_id is not None else f"{Path(source).name}:{index}"
    return Task(question=question, context=context, answers=answers, id=task_id)


def load_tasks(path: str | Path, field_map: dict[str, str] | None = None, require_answers: bool = True) -> list[Task]:
    """Read tasks from a JSON, JSONL or Parquet file and check every row.

    A row needs ``question`` (a non-empty string), ``context`` (a string, or a list of chunk
    strings) and ``answers`` (a string or a list of strings; finite numbers are accepted and
    written as text, ``42`` -> ``"42"``, ``2.5`` -> ``"2.5"``; booleans, NaN/Infinity, null and
    nested values are refused); ``id`` is optional. A ``.json`` file holds a list of rows (JSON
    Lines work too); a ``.jsonl`` file one row per line. Both must be UTF-8.

    Args:
        path: the file.
        field_map: maps ``question``/``context``/``answers``/``id`` to the file's column names.
        require_answers: False lets a row leave ``answers`` out or null (documents to predict on); answers
            that are given are checked all the same.

    Raises:
        DataError: unreadable or empty file (naming the line of invalid UTF-8 or JSON), or a row
            with a missing/empty/mistyped field (naming the row, its line and the field).
    """
    path = Path(path)
    fields = {"question": "question", "context": "context", "answers": "answers", "id": "id"}
    unknown = set(field_map or {}) - set(fields)
    if unknown:
        raise DataError(f"field_map: unknown keys {sorted(unknown)}; allowed: {sorted(fields)}")
    fields.update(field_map or {})
    if not path.is_file():
        raise DataError(f"{path}: no such file. Pass an existing JSON, JSONL or Parquet file.")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported extension {suffix!r}; use .json, .jsonl or .parquet")
    rows = [] if path.stat().st_size == 0 else read_parquet_rows(path) if suffix == ".parquet" else read_json_rows(path)
    if not rows:
        raise DataError(f"{path}: the file has no rows; it needs at least one task")
    return [_check_row(row, i, str(path), fields, line, require_answers) for i, (row, line) in enumerate(rows)]
