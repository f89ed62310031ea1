"""Reward-shaping and credit-attribution callbacks (importable as ``lightning_memrl.callbacks``)."""

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.callbacks.memory_credit import MemoryTokenCredit
from lightning_memrl.callbacks.overlong import OverlongPenalty

__all__ = ["MemRLCallback", "MemoryTokenCredit", "OverlongPenalty"]
