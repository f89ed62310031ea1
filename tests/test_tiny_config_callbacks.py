"""configs/memagent/tiny.yaml's reward shaping fires on the tiny model, by the amount worked out by hand."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from helpers import quiet_trainer

from lightning_memrl import (
    GenerationSettings,
    GRPOSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    SyntheticTaskSettings,
)
from lightning_memrl.callbacks import MemRLCallback, OverlongPenalty
from lightning_memrl.rewards import ExactMatch

TINY = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "memagent" / "tiny.yaml").read_text())


def _tiny_callback_args(name: str) -> dict:
    return next(c["init_args"] for c in TINY["trainer"]["callbacks"] if c["class_path"].endswith(name))


class TurnRewards(MemRLCallback):
    """Records the per-turn rewards and lengths the previous callbacks left."""

    def __init__(self) -> None:
        self.steps = []

    def on_rewards(self, trainer, module, rollouts):
        lengths = rollouts.response_mask.sum(-1)
        self.steps.append((rollouts.turn_rewards.clone(), lengths, rollouts.memory_turns.clone()))


def test_tiny_config_overlong_penalty_fires_by_the_hand_computed_amount(tmp_path):
    args = _tiny_callback_args("OverlongPenalty")
    model = TINY["model"]["init_args"]
    answer_cap = model["generation"]["max_new_tokens"]
    assert args["max_length"] == answer_cap  # L_max at the cap: the soft buffer lies inside reachable lengths
    penalty, recorder = OverlongPenalty(**args), TurnRewards()
    module = MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=model["workflow"]["init_args"]["max_memory_tokens"]),
        rewards=[ExactMatch()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=answer_cap),
        grpo=GRPOSettings(group_size=4),
    )
    data = MemRLDataModule(
        batch_size=2,
        synthetic=SyntheticTaskSettings(num_tasks=4, min_chunks=1, max_chunks=2, sentences_per_chunk=1),
        synthetic_val=SyntheticTaskSettings(num_tasks=2, seed=99, sentences_per_chunk=1),
    )
    quiet_trainer(tmp_path, steps=2, callbacks=[penalty, recorder]).fit(module, data)
    soft_start = args["max_length"] - args["cache_length"]
    penalised = 0
    for turn_rewards, lengths, is_memory in recorder.steps:
        # DAPO: 0 up to L_max - L_cache, then (L_max - L_cache - length) / L_cache, -1 at L_max
        expected = [
            0.0 if memory or n <= soft_start else max(-1.0, (soft_start - n) / args["cache_length"])
            for n, memory in zip(lengths.tolist(), is_memory.tolist())
        ]
        torch.testing.assert_close(turn_rewards, torch.tensor(expected))
        penalised += sum(e < 0 for e in expected)
    assert penalised > 0  # the random tiny model writes long answers: the penalty must bite
    assert penalty.penalised_turns == penalised
