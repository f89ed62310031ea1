"""Task files for the data tests: JSON/JSONL writers, a valid row, and a ``datasets`` cache kept in tmp."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path_factory, monkeypatch):
    """Keep the ``datasets`` cache of the files read here out of ~/.cache (autouse where imported)."""
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
