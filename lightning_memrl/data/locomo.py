"""LoCoMo: long multi-session conversations with questions, loaded as the project's tasks.

A LoCoMo file holds one conversation (``speaker_a``, ``speaker_b``, ``session_N`` turn lists with
``dia_id``, ``session_N_date_time``) and its ``qa`` list (``question``, ``answer``, ``evidence``
dia_ids, ``category``). The original release's layout (a list of ``{"sample_id",
"conversation", "qa"}`` objects) is read too. Each question becomes a :class:`~lightning_memrl.types.Task`
whose ``context`` is the list of session transcripts (so MemAgent reads one session per chunk)
and whose ``meta`` carries the parsed :class:`Conversation`, the category and the evidence ids
(what Memory-R1 and RMM build their memory banks from and score retrieval against).

Category 5 (adversarial, unanswerable) is left out by default, as in Memory-R1; everything left
out (by category, by the session cap, by the question cap) is counted and logged.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

log = logging.getLogger(__name__)


UNANSWERABLE = "Not mentioned in the conversation"


_SESSION_KEY = re.compile(r"session_(\d+)")


_DIA_ID = re.compile(r"D:?(\d+):(\d+)")


@dataclass
class DialogTurn:
    """One utterance of a session."""

    dia_id: str  # e.g. "D3:7" (session 3, turn 7)
    speaker: str
    text: str
    caption: str = ""  # caption of a shared photo (LoCoMo's blip_caption)

    def render(self) -> str:
        """``[D3:7] Caroline: text [shares a photo: caption]``."""
        photo = f" [shares a photo: {self.caption}]" if self.caption else ""
        return f"[{self.dia_id}] {self.speaker}: {self.text}{photo}"


@dataclass
class Session:
    """One dated session of a conversation."""

    index: int  # N of session_N
    date_time: str
    turns: list[DialogTurn] = field(default_factory=list)
    # LoCoMo's annotated facts of the session (``session_N_observation``): (fact, evidence dia_ids) in file order
    observations: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"session_{self.index}"

    def render(self, turns: list[DialogTurn] | None = None) -> str:
        """The transcript (of ``turns``, default all) headed by the session's date."""
        lines = [f"{self.name} ({self.date_time})"] + [t.render() for t in (self.turns if turns is None else turns)]
        return "\n".join(lines)


@dataclass
class Conversation:
    """A LoCoMo conversation: two speakers and their sessions in order."""

    id: str
    speaker_a: str
    speaker_b: str
    sessions: list[Session] = field(default_factory=list)

    @property
    def dia_ids(self) -> set[str]:
        return {t.dia_id for s in self.sessions for t in s.turns}


@dataclass
class LoCoMoSettings:
    """Which LoCoMo questions become tasks.

    Args:
        categories: question categories to keep (1-4 by default; 5 is adversarial).
        max_sessions: keep the first N sessions of each conversation, and only the questions
            whose evidence lies in them (None: all sessions). Caps the cost of building a bank.
        max_questions: keep at most this many questions per conversation, in file order.
        conversations: conversation ids to keep (file stems or ``sample_id``s; None: all).
    """

    categories: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    max_sessions: int | None = None
    max_questions: int | None = None
    conversations: list[str] | None = None


def normalize_evidence(raw: Any) -> list[str]:
    """Evidence ids as ``D<session>:<turn>``: ``"D8:6; D9:17"`` is split, ``"D:11:26"`` fixed."""
    items = raw if isinstance(raw, list) else [raw]
    out: list[str] = []
    for item in items:
        for part in re.split(r"[;,\s]+", str(item)):
            match = _DIA_ID.fullmatch(part.strip())
            out.append(f"D{match.group(1)}:{match.group(2)}" if match else part.strip())
    return [e for e in dict.fromkeys(out) if e]


def session_of(dia_id: str) -> int | None:
    """Session number of a ``dia_id`` (``D3:7`` -> 3), None when it is malformed."""
    match = _DIA_ID.fullmatch(dia_id)
    return int(match.group(1)) if match else None


def _observations(raw: Any, where: str) -> list[tuple[str, list[str]]]:
    """A session's annotated facts ``{speaker: [[fact, dia_id or list], ...]}`` as (fact, dia_ids); absent: []."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object {{speaker: [[fact, dia_id], ...]}}")
    out = []
    for speaker, rows in raw.items():
        for i, row in enumerate(rows if isinstance(rows, list) else [None]):
            if not isinstance(row, list) or len(row) != 2 or not isinstance(row[0], str):
                raise DataError(f"{where}[{speaker!r}][{i}]: expected [fact, dia_id or list of dia_ids], got {row!r}")
            out.append((" ".join(row[0].split()), normalize_evidence(row[1])))
    return out


def _parse_conversation(obj: Any, conv_id: str, source: str) -> Conversation:
    if not isinstance(obj, dict):
        raise DataError(f"{source}: expected a JSON object with speaker_a, speaker_b and session_N keys")
    for key in ("speaker_a", "speaker_b"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise DataError(f"{source}: field '{key}' is missing or empty")
    indices = sorted(int(m.group(1)) for k in obj if (m := _SESSION_KEY.fullmatch(k)))
    if not indices:
        raise DataError(f"{source}: no session_N fields; a LoCoMo conversation needs at least one session")
    sessions = []
    for n in indices:
        key = f"session_{n}"
        turns_raw = obj[key]
        if not isinstance(turns_raw, list):
            raise DataError(f"{source}: field '{key}' must be a list of turns")
        turns = []
        for i, turn in enumerate(turns_raw):
            where = f"{source}: {key}[{i}]"
            if not isinstance(turn, dict):
                raise DataError(f"{where}: a turn must be an object with speaker, dia_id and text")
            for name in ("speaker", "dia_id", "text"):
                if not isinstance(turn.get(name), str) or (name != "text" and not turn[name].strip()):
                    raise DataError(f"{where}: field '{name}' is missing or not a string")
            turns.append(
                DialogTurn(turn["dia_id"].strip(), turn["speaker"], turn["text"], turn.get("blip_caption") or "")
            )
        date = obj.get(f"{key}_date_time", "")
        observations = _observations(obj.get(f"{key}_observation"), f"{source}: {key}_observation")
        sessions.append(Session(n, str(date), turns, observations))
    return Conversation(conv_id, obj["speaker_a"], obj["speaker_b"], sessions)


def _read_file(path: Path) -> list[tuple[Conversation, list[Any], str]]:
    """(conversation, raw qa list, source label) for every conversation in one file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read as JSON: {err}") from err
    if isinstance(data, dict):
        items, original_layout = [data], False
    elif isinstance(data, list):
        items, original_layout = data, True
    else:
        raise DataError(f"{path}: expected a JSON object (one conversation) or a list of them")
    out = []
    for index, item in enumerate(items):
        source = f"{path}" if not original_layout else f"{path}: [{index}]"
        if original_layout and isinstance(item, dict) and "conversation" in item:
            conv_id, conv_obj = str(item.get("sample_id", f"{path.stem}-{index}")), item["conversation"]
        else:
            conv_id = str(item.get("sample_id", path.stem if not original_layout else f"{path.stem}-{index}"))
            conv_obj = item
        conversation = _parse_conversation(conv_obj, conv_id, source)
        qa = item.get("qa") if isinstance(item, dict) else None
        if not isinstance(qa, list):
            raise DataError(f"{source}: field 'qa' is missing or not a list of questions")
        out.append((conversation, qa, source))
    return out


def _locomo_files(path: Path) -> list[Path]:
    """The LoCoMo JSON files at ``path`` (one file, or every ``*.json`` of a folder, sorted by name)."""
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise DataError(f"{path}: folder has no *.json LoCoMo files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{path}: no such file or folder. Set --data.init_args.locomo_path to LoCoMo JSON data.")


def _check_question(row: Any, where: str) -> tuple[str, int]:
    """The question text and category of one ``qa`` row; a missing or mistyped field raises."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a question must be an object with question, answer, evidence, category")
    question, category = row.get("question"), row.get("category")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field 'question' is missing or empty")
    if isinstance(category, bool) or not isinstance(category, int):
        raise DataError(f"{where}: field 'category' must be an integer, got {category!r}")
    return question.strip(), category


def _answer_text(row: dict[str, Any], category: int, where: str) -> str:
    """The gold answer as text (``3.0`` -> ``"3"``); an unanswered category-5 question gets :data:`UNANSWERABLE`."""
    answer = row.get("answer")
    if answer is None and category == 5:
        answer = UNANSWERABLE
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"{where}: field 'answer' must be a non-empty string or number, got {answer!r}")
    return str(int(answer)) if isinstance(answer, float) and answer.is_integer() else str(answer)


def _question_task(
    conversation: Conversation, index: int, question: str, answer: str, category: int, evidence: list[str]
) -> Task:
    """The task of question ``index`` of ``conversation``: its sessions are the context chunks."""
    return Task(
        question=question,
        context=[s.render() for s in conversation.sessions],
        answers=[answer],
        id=f"{conversation.id}:qa{index}",
        meta={
            "conversation": conversation,
            "conversation_id": conversation.id,
            "category": category,
            "evidence": evidence,
            "context_unit": "sessions",  # what the evaluation report and plots count the context in
        },
    )


def _conversation_tasks(
    conversation: Conversation, qa: list[Any], source: str, settings: LoCoMoSettings, skipped: Counter[str]
) -> tuple[list[Task], int]:
    """The kept questions of one conversation as tasks, and how many evidence ids name no turn of it.

    Cuts the conversation to ``settings.max_sessions``; every question left out is counted in ``skipped``.
    """
    if settings.max_sessions is not None:
        conversation.sessions = conversation.sessions[: settings.max_sessions]
    last_session = conversation.sessions[-1].index
    known_ids = conversation.dia_ids
    tasks: list[Task] = []
    unknown_evidence = 0
    for i, row in enumerate(qa):
        where = f"{source}: qa[{i}]"
        question, category = _check_question(row, where)
        if category not in settings.categories:
            skipped[f"category {category}"] += 1
            continue
        answer = _answer_text(row, category, where)
        evidence = normalize_evidence(row.get("evidence", []))
        if any(s is not None and s > last_session for s in map(session_of, evidence)):
            skipped["evidence after max_sessions"] += 1
            continue
        if settings.max_questions is not None and len(tasks) >= settings.max_questions:
            skipped["over max_questions"] += 1
            continue
        unknown_evidence += sum(e not in known_ids for e in evidence)
        tasks.append(_question_task(conversation, i, question, answer, category, evidence))
    return tasks, unknown_evidence


def _log_kept(path: Path, tasks: list[Task], skipped: Counter[str], unknown_evidence: int) -> None:
    """Log the questions kept per category and those left out, and warn of evidence ids that name no turn."""
    by_category = Counter(t.meta["category"] for t in tasks)
    log.info(
        "LoCoMo %s: %d questions kept %s; left out: %s",
        path,
        len(tasks),
        dict(sorted(by_category.items())),
        dict(skipped) or "none",
    )
    if unknown_evidence:
        log.warning(
            "LoCoMo %s: %d evidence ids name no turn of their conversation (kept, never retrievable)",
            path,
            unknown_evidence,
        )


def load_locomo(path: str | Path, settings: LoCoMoSettings | None = None) -> list[Task]:
    """Read LoCoMo conversations (one file, or every ``*.json`` in a folder) into tasks.

    Args:
        path: a LoCoMo JSON file or a folder of them.
        settings: which questions to keep.

    Raises:
        DataError: missing path, unreadable file, or a conversation/question with a missing or
            mistyped field (the message names the file, the item and the field).
    """
    settings = settings or LoCoMoSettings()
    path = Path(path)
    files = _locomo_files(path)
    if settings.max_sessions is not None and settings.max_sessions < 1:
        raise DataError(f"locomo.max_sessions must be >= 1 or null, got {settings.max_sessions}")
    wanted = set(settings.conversations) if settings.conversations is not None else None
    tasks: list[Task] = []
    skipped: Counter[str] = Counter()
    unknown_evidence = 0
    seen_ids: set[str] = set()
    for file in files:
        for conversation, qa, source in _read_file(file):
            seen_ids.add(conversation.id)
            if wanted is not None and conversation.id not in wanted:
                continue
            kept, unknown = _conversation_tasks(conversation, qa, source, settings, skipped)
            tasks += kept
            unknown_evidence += unknown
    if wanted is not None and wanted - seen_ids:
        raise DataError(
            f"{path}: locomo.conversations names unknown ids {sorted(wanted - seen_ids)}; have {sorted(seen_ids)}"
        )
    _log_kept(path, tasks, skipped, unknown_evidence)
    if not tasks:
        raise DataError(f"{path}: no LoCoMo question left after filtering ({dict(skipped)}); widen locomo settings")
    return tasks
