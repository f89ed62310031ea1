"""A tiny conversation in the LoCoMo format, written by the tests themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def locomo_conversation() -> dict[str, Any]:
    """Two speakers, three sessions with annotated facts and summaries, five questions (one of category 5)."""
    return {
        "speaker_a": "Ana",
        "speaker_b": "Ben",
        "session_1_date_time": "1:00 pm on 3 May, 2023",
        "session_1": [
            {"speaker": "Ana", "dia_id": "D1:1", "text": "I adopted a cat named Miso."},
            {"speaker": "Ben", "dia_id": "D1:2", "text": "Nice! I started learning the violin."},
        ],
        "session_2_date_time": "2:00 pm on 9 May, 2023",
        "session_2": [
            {"speaker": "Ana", "dia_id": "D2:1", "text": "Miso broke a vase.", "blip_caption": "a broken blue vase"},
            {"speaker": "Ben", "dia_id": "D2:2", "text": "I moved to Lisbon last week."},
        ],
        "session_3_date_time": "9:00 am on 2 June, 2023",
        "session_3": [
            {"speaker": "Ben", "dia_id": "D3:1", "text": "My violin teacher is called Rosa."},
        ],
        "events_session_1": {"Ana": ["Ana adopts a cat."], "Ben": [], "date": "3 May, 2023"},
        # LoCoMo's annotated facts per session: {speaker: [[fact, dia_id or list of dia_ids], ...]}
        "session_1_observation": {
            "Ana": [["Ana adopted a cat named Miso.", "D1:1"]],
            "Ben": [["Ben started learning the violin.", "D1:2"]],
        },
        "session_2_observation": {
            "Ana": [["Ana's cat Miso broke a vase.", "D2:1"]],
            "Ben": [["Ben moved to Lisbon.", "D2:2"], ["Ben started  learning the Violin.", "D2:2"]],
        },
        "session_3_observation": {
            "Ben": [["Ben's violin teacher is Rosa.", ["D3:1", "D1:2"]]],
            "Ana": [["Ana likes green tea.", "D9:9"]],
        },
        "session_1_summary": "Ana adopted a cat, Miso; Ben started the violin.",
        "session_2_summary": "Miso broke a vase; Ben moved to Lisbon.",
        "session_3_summary": "Ben's violin teacher is Rosa.",
        "qa": [
            {"question": "What is the name of Ana's cat?", "answer": "Miso", "evidence": ["D1:1"], "category": 4},
            {"question": "Where did Ben move?", "answer": "Lisbon", "evidence": ["D2:2"], "category": 4},
            {"question": "In what year did Ana adopt a cat?", "answer": 2023, "evidence": ["D1:1"], "category": 2},
            {"question": "Who teaches Ben?", "answer": "Rosa", "evidence": ["D3:1; D1:2"], "category": 1},
            {
                "question": "What did Ben's cat break?",
                "evidence": ["D2:1"],
                "category": 5,
                "adversarial_answer": "a vase",
            },
        ],
    }


def write_locomo(folder: Path, name: str = "conv-test", conversation: dict[str, Any] | None = None) -> Path:
    """Write one conversation as ``folder/name.json`` and return the path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(conversation if conversation is not None else locomo_conversation()))
    return path


def write_two_conversations(folder: Path) -> Path:
    """Write ``conv-a`` and ``conv-b`` (the same dialogue with Ana renamed Eva) into ``folder``; the folder."""
    write_locomo(folder, "conv-a")
    write_locomo(folder, "conv-b", json.loads(json.dumps(locomo_conversation()).replace("Ana", "Eva")))
    return folder
