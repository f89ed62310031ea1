"""A rollout backend that answers each prompt with a scripted text (no model)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Generation


class ScriptedEngine(RolloutBackend):
    """``reply(prompt_text) -> response text``; records every prompt and its settings."""

    def __init__(self, tokenizer, reply: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.calls: list[tuple[str, float]] = []  # (prompt text, temperature)

    def generate(self, prompts, settings: GenerationSettings, max_new_tokens=None, prefix_labels=None, task_ids=None):
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            self.calls.append((text, settings.temperature))
            ids = self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"] + [
                self.tokenizer.eos_token_id
            ]
            out.append(Generation(ids, torch.zeros(len(ids)), False))
        return out

    def sync_weights(self, model) -> None:
        """No weights: the script does not change with the policy."""
