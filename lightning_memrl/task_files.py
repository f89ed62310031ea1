"""Raw rows of a task file: JSON and JSON Lines read line by line, Parquet through ``pyarrow``.

JSON is decoded here (strict UTF-8, the ``json`` module) rather than through ``datasets`` so that
an error names the file and the line: an invalid byte, a line that is not JSON, a line that is not
an object. Every row comes back with the line it starts on, which the row checks then name too.
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import Any

from lightning_memrl.errors import DataError

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
