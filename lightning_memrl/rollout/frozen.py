"""The fixed model a workflow's frozen agents generate with while the policy trains.

Memory-R1 trains its memory manager against a frozen answer agent (and its answer agent on banks
that a frozen extractor and manager wrote); RMM's prospective reflection is frozen while its
generator trains. "Frozen" must mean a model that does not change: generating those turns with
the policy being trained, and only leaving them out of the loss, lets the frozen agent drift with
every optimizer step (and the reward it gives with it). :class:`FrozenRolloutEngine` is a
:class:`~lightning_memrl.rollout.hf.RolloutEngine` over such a model: a frozen copy of the initial
weights, or the LoRA policy with its adapters disabled around every ``generate``, or (with
``lora.frozen_adapter_name_or_path``) the LoRA policy with a saved adapter of its own switched on
around every ``generate`` (:func:`adapter_engine`: e.g. the trained memory manager while the answer
agent trains).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from lightning_memrl.adapters import adapter_config
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Generation

FROZEN_ADAPTER = "frozen"  # peft name of the adapter lora.frozen_adapter_name_or_path loads (adapter_files matches it)


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


@contextmanager
def adapter_switched_on(policy: Any, name: str) -> Iterator[None]:
    """Inside: the peft ``policy`` computes with its adapter ``name`` only; after: the adapter active before,
    and every parameter's ``requires_grad`` as it was (peft's ``set_adapter`` changes them)."""
    previous = policy.active_adapter
    grads = [(p, p.requires_grad) for p in policy.parameters()]
    policy.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        policy.set_adapter(previous)
        for param, flag in grads:
            param.requires_grad_(flag)


def adapter_engine(policy: Any, tokenizer: Any, path: str, share_prefixes: bool = True) -> FrozenRolloutEngine:
    """A frozen engine over the LoRA ``policy`` with the saved adapter at ``path`` loaded next to its
    trained one (as :data:`FROZEN_ADAPTER`, never trained) and switched on around every ``generate``.

    Args:
        policy: the peft-wrapped policy.
        tokenizer: its tokenizer.
        path: a folder peft's ``save_pretrained`` wrote, or a hub id (``lora.frozen_adapter_name_or_path``).
        share_prefixes: prefill shared prompt prefixes once (see :class:`~lightning_memrl.rollout.hf.RolloutEngine`).

    Raises:
        FileNotFoundError: no LoRA adapter at ``path`` (the message names the option).
    """
    if FROZEN_ADAPTER not in policy.peft_config:
        adapter_config(path, "frozen_adapter_name_or_path")  # one clear error when there is none
        policy.load_adapter(path, adapter_name=FROZEN_ADAPTER, is_trainable=False)
        for name, param in policy.named_parameters():
            if f".{FROZEN_ADAPTER}." in name:
                param.requires_grad_(False)
    return FrozenRolloutEngine(
        policy,
        tokenizer,
        f"the LoRA adapter {path} (frozen) on the base model",
        context=lambda: adapter_switched_on(policy, FROZEN_ADAPTER),
        share_prefixes=share_prefixes,
    )
