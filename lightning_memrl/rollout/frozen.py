"""The fixed model a workflow's frozen agents generate with while the policy trains.

Memory-R1 trains its memory manager against a frozen answer agent (and its answer agent on banks
that a frozen extractor and manager wrote); RMM's prospective reflection is frozen while its
generator trains. "Frozen" must mean a model that does not change: generating those turns with
the policy being trained, and only leaving them out of the loss, lets the frozen agent drift with
every optimizer step (and the reward it gives with it). :class:`FrozenRolloutEngine` is a
:class:`~lightning_memrl.rollout.hf.RolloutEngine` over such a model: a frozen copy of the initial
weights, or the LoRA policy with its adapters disabled around every ``generate``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Generation


class FrozenRolloutEngine(RolloutEngine):
    """A rollout engine over a model that never trains.

    Args:
        model: the frozen model, or the LoRA policy whose adapters ``context`` disables.
        tokenizer: its tokenizer.
        description: which model this is, for logs (e.g. "a frozen copy of the initial weights").
        context: entered around every ``generate`` (e.g. ``policy.disable_adapter``); None: nothing.
        **kwargs: passed to :class:`~lightning_memrl.rollout.hf.RolloutEngine` (``share_prefixes``, ...).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        description: str,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.description = description
        self.context = context

    def generate(
        self, prompts: list[list[int]], settings: GenerationSettings, *args: Any, **kwargs: Any
    ) -> list[Generation]:
        """``RolloutEngine.generate`` inside ``context`` (adapters disabled)."""
        with self.context() if self.context is not None else nullcontext():
            return super().generate(prompts, settings, *args, **kwargs)


def engine_description(engine: Any) -> str:
    """Which model an engine generates with, for logs: a frozen engine's description, else the policy."""
    return getattr(engine, "description", "the policy being trained")
