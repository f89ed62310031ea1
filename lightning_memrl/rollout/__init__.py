"""Rollout backends: generate token ids with their log-probs for a batch of prompts."""

from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.frozen import FrozenRolloutEngine
from lightning_memrl.rollout.hf import RolloutEngine

__all__ = ["FrozenRolloutEngine", "RolloutBackend", "RolloutEngine"]
