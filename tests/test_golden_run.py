"""Golden run: three GRPO steps whose metrics and weight changes must not move when code is reshaped.

The rollouts are scripted (no sampling), so the run is the same on every CPU: only the update
(log-probs, shared prefixes, advantages, the clipped loss with KL, two PPO epochs, clipping, AdamW)
computes, and its floating-point noise is far below the tolerances. Regenerate the file only when a
change is meant to alter the numbers: ``MEMRL_WRITE_GOLDEN=1 python -m pytest tests/test_golden_run.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import AnswerLength, quiet_trainer
from scripted_engine import ScriptedEngine

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    OptimizerSettings,
    SyntheticTaskSettings,
)
from lightning_memrl.models import build_tiny_model, build_tiny_tokenizer

GOLDEN = Path(__file__).with_name("golden") / "tiny_scripted_3_steps.json"
METRICS = ("train/loss", "train/grad_norm", "train/kl", "train/reward", "train/advantage_abs", "train/clip_frac")


class ScriptedModule(MemRLModule):
    """The real module with a rollout engine that replies by a fixed script (the k-th call's text)."""

    def configure_model(self) -> None:
        super().configure_model()
        count = iter(range(10**9))
        words = ["keep", "code", "note", "Alice", "1234"]

        def reply(prompt: str) -> str:  # lengths and words vary across group members: non-zero advantages
            k = next(count)
            return " ".join(words[(k + i) % len(words)] for i in range(1 + k % 4))

        self.engine = ScriptedEngine(self.tokenizer, reply)


class MetricsRecorder(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(trainer.callback_metrics[k]) for k in METRICS})


def _golden_run(tmp_path: Path) -> dict:
    L.seed_everything(0)
    module = ScriptedModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=4, kl_coef=0.05, ppo_epochs=2, clip_low=0.1, clip_high=0.1),
        optimizer=OptimizerSettings(lr=1e-3),
    )
    data = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=8, sentences_per_chunk=1))
    recorder = MetricsRecorder()
    quiet_trainer(tmp_path, steps=6, callbacks=[recorder]).fit(module, data)  # 3 batches x 2 PPO epochs
    initial = build_tiny_model(build_tiny_tokenizer(), seed=0).state_dict()
    deltas = {}
    for name, value in module.policy.state_dict().items():
        delta = (value.detach().double() - initial[name].double()).flatten()
        deltas[name] = [float(delta.sum()), float(delta.norm())]
    return {"metrics": recorder.rows, "weight_deltas": deltas}


def test_three_scripted_steps_reproduce_the_golden_metrics_and_weights(tmp_path):
    run = _golden_run(tmp_path)
    if os.environ.get("MEMRL_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(run, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN.name}")
    golden = json.loads(GOLDEN.read_text())
    assert len(run["metrics"]) == len(golden["metrics"]) == 3
    for step, (got, want) in enumerate(zip(run["metrics"], golden["metrics"])):
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (step, key)
    assert set(run["weight_deltas"]) == set(golden["weight_deltas"])
    moved = 0
    for name, (total, norm) in run["weight_deltas"].items():
        want_total, want_norm = golden["weight_deltas"][name]
        assert norm == pytest.approx(want_norm, rel=1e-3, abs=1e-6), name
        assert total == pytest.approx(want_total, rel=1e-2, abs=1e-5 + 1e-3 * want_norm), name
        moved += want_norm > 0
    assert moved > len(golden["weight_deltas"]) // 2  # the run trains most tensors: the check has teeth
    assert torch.isfinite(torch.tensor([m["train/loss"] for m in run["metrics"]])).all()
