"""The rollout backend contract: what ``MemRLModule``, its learner and the workflows ask of an engine.

A backend turns prompt token ids into generated token ids with the log-probability of each under
the sampling temperature (token-in/token-out: the update trains on these exact ids and never
re-tokenises text). ``MemRLModule`` builds one from its ``rollout`` option,
``rollout(policy, tokenizer)``: in YAML ``model.init_args.rollout: {class_path: ..., init_args:
{...}}``, where ``init_args`` are the backend's own options after ``model`` and ``tokenizer``.
The default is the in-process ``transformers`` engine,
:class:`~lightning_memrl.rollout.hf.RolloutEngine`.

After every optimizer step the learner calls :meth:`RolloutBackend.sync_weights` with the policy
(``ppo_epochs`` calls per batch): a backend that samples from its own copy of the weights (vLLM,
SGLang, a compiled engine) loads the new ones there. A step skipped by the non-finite guard changes
no weight and is not followed by a call. ``MemRLModule`` also calls it when training, validation
or testing starts, since the policy may have been loaded from a checkpoint (or moved to its device)
after the backend was built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from lightning_memrl.rollout.prefix import MIN_SHARED_PREFIX
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import Generation


class RolloutBackend(ABC):
    """A batched sampler of token ids with their log-probs.

    Attributes:
        tokenizer: the policy's tokenizer; workflows encode prompts and decode responses with it.
        min_shared_prefix: shortest prompt prefix, in tokens, that members of a group share for it
            to be computed once; the learner groups update rows by the same threshold.
    """

    tokenizer: Any
    min_shared_prefix: int = MIN_SHARED_PREFIX

    @property
    def pad_id(self) -> int:
        """Token id that pads prompts and responses: the tokenizer's pad token, else its EOS."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    @abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        settings: GenerationSettings,
        max_new_tokens: int | None = None,
        prefix_labels: list[Any] | None = None,
        task_ids: list[str] | None = None,
    ) -> list[Generation]:
        """Sample one response per prompt.

        Args:
            prompts: prompt token ids, one list per conversation.
            settings: sampling settings; ``temperature <= 0`` is greedy.
            max_new_tokens: overrides ``settings.max_new_tokens`` for this call.
            prefix_labels: one label per prompt; prompts with equal labels share a prefix (a hint a
                backend may use to compute that prefix once). None: no hint.
            task_ids: the id of the task each prompt belongs to, for error messages.

        Returns:
            One :class:`~lightning_memrl.types.Generation` per prompt, in order: the generated ids up
            to and including the first EOS or stop string, the log-prob [S] of each under the
            sampling temperature (``log softmax(logits / temperature)``, temperature 1 when greedy),
            and whether the response was cut at ``max_new_tokens``.

        Raises:
            DataError: a prompt longer than the backend (or ``settings.max_prompt_length``) allows.
        """

    @abstractmethod
    def sync_weights(self, model: Any) -> None:
        """Make the next ``generate`` sample from ``model``'s current weights.

        Called with the policy after every optimizer step that was not skipped (``ppo_epochs``
        steps per batch) and when training, validation or testing starts. A backend that samples
        from the live policy in-process does nothing here.
        """

    def release_memory(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing to free)
        """Free what the backend holds only while sampling; called by ``MemRLModule`` after each rollout.

        The next ``generate`` rebuilds it. The default engine frees its merged LoRA weights here, so
        they do not add to the update's peak memory. Default: nothing.
        """


RolloutBackendFactory = Callable[[Any, Any], RolloutBackend]
"""Builds a backend from ``(model, tokenizer)``: a backend class, or (from YAML) the class with its
``init_args`` bound."""


def check_backend(backend: Any, option: str) -> RolloutBackend:
    """``backend`` if it implements the contract, else a TypeError naming ``option``."""
    if not isinstance(backend, RolloutBackend):
        raise TypeError(
            f"{option} built a {type(backend).__module__}.{type(backend).__qualname__}, which is not a rollout "
            "backend: subclass lightning_memrl.rollout.base.RolloutBackend and implement generate and sync_weights"
        )
    return backend
