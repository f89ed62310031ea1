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
agent trains). :func:`load_reference_adapter` loads the KL term's fixed adapter the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from lightning_memrl.adapter_files import FROZEN_ADAPTER, REFERENCE_ADAPTER
from lightning_memrl.adapters import adapter_config
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Generation

log = logging.getLogger(__name__)


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


def load_fixed_adapter(policy: Any, path: str, name: str, option: str) -> None:
    """Load the saved LoRA adapter at ``path`` into the peft ``policy`` as adapter ``name``, never trained
    (kept out of checkpoints: it is re-loaded from its path); nothing happens when ``name`` is loaded.

    Raises:
        FileNotFoundError: no LoRA adapter at ``path`` (the message names the lora ``option``).
    """
    if name in policy.peft_config:
        return
    adapter_config(path, option)  # one clear error when there is none
    policy.load_adapter(path, adapter_name=name, is_trainable=False)
    for param_name, param in policy.named_parameters():
        if f".{name}." in param_name:
            param.requires_grad_(False)


def load_reference_adapter(policy: Any, lora: Any, kl_coef: float) -> None:
    """Load ``lora.reference_adapter_name_or_path`` (if ``lora`` is set and has it) into the peft ``policy`` as
    :data:`REFERENCE_ADAPTER`, the KL term's reference; with ``kl_coef`` 0 nothing uses it: a warning, no load."""
    path = getattr(lora, "reference_adapter_name_or_path", None)
    if path is None:
        return
    if kl_coef <= 0:
        log.warning(
            "model.init_args.lora.reference_adapter_name_or_path=%r is not loaded: grpo.kl_coef is 0, so no KL "
            "term uses a reference (set grpo.kl_coef > 0, or leave the option out)",
            path,
        )
        return
    load_fixed_adapter(policy, path, REFERENCE_ADAPTER, "reference_adapter_name_or_path")
    log.info("KL reference: the LoRA adapter %s (fixed) on the base model", path)


def lora_reference(policy: Any) -> AbstractContextManager[Any]:
    """The context in which the LoRA ``policy`` computes as the KL reference: only
    :data:`REFERENCE_ADAPTER` on when it is loaded, else every adapter disabled (the base)."""
    if REFERENCE_ADAPTER in policy.peft_config:
        return adapter_switched_on(policy, REFERENCE_ADAPTER)
    return policy.disable_adapter()


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
    load_fixed_adapter(policy, path, FROZEN_ADAPTER, "frozen_adapter_name_or_path")
    return FrozenRolloutEngine(
        policy,
        tokenizer,
        f"the LoRA adapter {path} (frozen) on the base model",
        context=lambda: adapter_switched_on(policy, FROZEN_ADAPTER),
        share_prefixes=share_prefixes,
    )
