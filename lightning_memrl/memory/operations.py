"""Reading a memory operation (ADD / UPDATE / DELETE / NOOP) from a memory manager's output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from lightning_memrl.memory.bank import MemoryOp


@dataclass
class ParsedOperation:
    """A memory operation read from model output; ``valid`` is False when the output was unusable."""

    op: MemoryOp
    target_id: str | None = None
    text: str = ""
    valid: bool = True
    problem: str = ""


_OP_SYNONYMS = {"ADD": "ADD", "UPDATE": "UPDATE", "MERGE": "UPDATE", "DELETE": "DELETE", "NOOP": "NOOP", "NONE": "NOOP"}


_OP_LINE = re.compile(
    r"\b(ADD|UPDATE|MERGE|DELETE|NOOP|NONE)\b[\s:,\-]*(?:\[?(m\d+)\]?)?[\s:,\-]*(.*)", re.IGNORECASE | re.DOTALL
)


def _first_json_object(text: str) -> dict[str, Any] | None:
    """The first ``{...}`` in ``text`` that parses as a JSON object."""
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start : end + 1])
                except json.JSONDecodeError:
                    break
                return value if isinstance(value, dict) else None
    return None


def parse_memory_operation(text: str, valid_ids: set[str] | list[str], fact: str = "") -> ParsedOperation:
    """Read one operation from a manager's output, never raising.

    Accepts JSON (``{"op": "UPDATE", "id": "m3", "text": "..."}``; keys ``operation``/``event``
    and ``memory``/``new_text`` also work) or a line such as ``UPDATE m3: new text``. ``MERGE`` means
    ``UPDATE``. ADD and UPDATE without text use ``fact``. Output that names no operation, or an
    UPDATE/DELETE of an id not in ``valid_ids``, comes back as an invalid NOOP with the problem.
    """
    valid_ids = set(valid_ids)
    obj = _first_json_object(text)
    if obj is not None:
        raw_op = next((obj[k] for k in ("op", "operation", "event", "action") if k in obj), None)
        target = next((obj[k] for k in ("id", "memory_id", "target", "target_id") if k in obj), None)
        new_text = next((obj[k] for k in ("text", "memory", "new_text", "content") if k in obj), "")
    else:
        match = _OP_LINE.search(text)
        if match is None:
            return ParsedOperation(MemoryOp.NOOP, valid=False, problem="no operation found")
        raw_op, target, new_text = match.group(1), match.group(2), match.group(3)
        loose = re.search(r"\b(m\d+)\b", new_text) if target is None else None
        if loose is not None and _OP_SYNONYMS.get(raw_op.upper()) in ("UPDATE", "DELETE"):  # e.g. broken JSON
            target, new_text = loose.group(1), new_text[loose.end() :].strip(" \"':,;}-\n")
    op_name = _OP_SYNONYMS.get(str(raw_op).strip().upper()) if raw_op is not None else None
    if op_name is None:
        return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"unknown operation {raw_op!r}")
    op = MemoryOp(op_name)
    target = str(target).strip().strip("[]") if target not in (None, "") else None
    new_text = " ".join(str(new_text).split()) if new_text is not None else ""
    if op in (MemoryOp.UPDATE, MemoryOp.DELETE) and target not in valid_ids:
        return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"{op.value} of unknown memory id {target!r}")
    if op in (MemoryOp.ADD, MemoryOp.UPDATE) and not new_text:
        new_text = " ".join(fact.split())
        if not new_text:
            return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"{op.value} without text")
    return ParsedOperation(
        op, target if op is not MemoryOp.ADD else None, new_text if op is not MemoryOp.DELETE else ""
    )
