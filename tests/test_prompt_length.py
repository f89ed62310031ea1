"""A prompt longer than the model's context (or ``max_prompt_length``) stops with its task, never allocates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_memrl.errors import DataError
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Task
from lightning_memrl.workflows.memagent import MemAgentWorkflow

REPO = Path(__file__).resolve().parents[1]


def _refuse_forward(model):
    def forward(*args, **kwargs):
        raise AssertionError("the model ran on a prompt that does not fit")

    model.forward = forward


def test_prompt_over_the_models_context_stops_before_the_forward(tiny_model, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(tiny_model.config, "max_position_embeddings", 64)
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    fits = engine.generate([[5] * 48], GenerationSettings(temperature=0.0), max_new_tokens=16)
    assert len(fits[0].token_ids) >= 1  # 48 + 16 = 64 positions: exactly the context
    _refuse_forward(tiny_model)
    with pytest.raises(DataError) as info:
        engine.generate([[5] * 10, [5] * 49], GenerationSettings(), max_new_tokens=16, task_ids=["short", "long"])
    assert str(info.value).startswith(
        "task 'long': a prompt of 49 tokens is longer than the limit of 48 tokens "
        "(the model's max_position_embeddings=64 minus 16 new tokens)"
    )


def test_max_prompt_length_option(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=2, max_prompt_length=12)
    assert len(engine.generate([[5] * 12], settings)) == 1
    _refuse_forward(tiny_model)
    with pytest.raises(DataError, match=r"^prompt 1 of this turn: a prompt of 13 tokens .* limit of 12 tokens "):
        engine.generate([[5] * 3, [5] * 13], settings)
    # a limit above what the context leaves is not used: the context wins
    huge = GenerationSettings(max_new_tokens=96, max_prompt_length=10_000)
    with pytest.raises(DataError, match=r"limit of 4000 tokens \(the model's max_position_embeddings=4096"):
        engine.generate([[5] * 4001], huge)


def test_memagent_names_the_task_whose_question_is_too_long(tiny_model, tiny_tokenizer):
    short = Task("What is the secret code of Alice?", ["The secret code of Alice is 1234."], ["1234"], id="ok")
    long = Task("What is the secret code of Alice? " * 40, ["The secret code of Alice is 1234."], ["1234"], id="big")
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    _refuse_forward(tiny_model)
    settings = GenerationSettings(max_new_tokens=4, max_prompt_length=120)
    with pytest.raises(DataError, match=r"^task 'big': a prompt of \d{3} tokens is longer than the limit of 120"):
        MemAgentWorkflow(max_memory_tokens=8).rollout(engine, [short, short, long, long], settings)


# --------------------------------------------------------------------------- the real command
def _fit(tmp_path: Path, train_file: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lightning-memrl")
    args = [
        "fit",
        "--config",
        str(REPO / "configs" / "memagent" / "tiny.yaml"),
        "--data.init_args.train_path",
        str(train_file),
    ]
    args += ["--trainer.max_steps", "1"]
    return subprocess.run([str(exe), *args], cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True)


GOOD = json.dumps({"question": "What is the secret code of Alice?", "context": ["Alice: 1234."], "answers": ["1234"]})


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ((GOOD + "\n" + GOOD + "\n" + '{"question": "q?", "context": \n').encode(), "line 3: cannot read as jsonl"),
        ((GOOD + "\n").encode() + GOOD.encode().replace(b"Alice", b"Al\xefce", 1) + b"\n", "line 2: not valid UTF-8"),
    ],
    ids=["invalid-json-line", "invalid-utf8"],
)
def test_cli_bad_file_prints_one_message_with_file_and_line(tmp_path, content, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    proc = _fit(tmp_path, bad)
    assert proc.returncode == 2
    assert f"error: {bad}: {expected}" in proc.stderr
    assert "Traceback" not in proc.stderr and "An error occurred while generating" not in proc.stderr


def test_cli_600kb_question_stops_with_its_task_and_the_limit(tmp_path):
    question = ("What is the secret code of Alice? " * 20_000)[:600_000]
    rows = [{"id": "huge", "question": question, "context": ["Alice: 1234."], "answers": ["1234"]}, json.loads(GOOD)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _fit(tmp_path, train)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: task 'huge': a prompt of " in proc.stderr
    assert "longer than the limit of 4080 tokens (the model's max_position_embeddings=4096" in proc.stderr
    assert "Traceback" not in proc.stderr
