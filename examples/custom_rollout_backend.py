"""A rollout backend that samples from its own copy of the policy's weights.

A separate inference engine (vLLM, SGLang, a compiled static-cache engine) holds its own copy of
the weights, so it must be handed the new ones after every optimizer step, or the next rollouts
come from a stale policy and their log-probs no longer match the policy being trained. This
backend shows that contract in one file: it generates with a private copy of the model made when
it is built, and :meth:`SnapshotRolloutEngine.sync_weights` (called by the learner after every
optimizer step that is not skipped) copies the policy's weights into it.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/memagent/tiny.yaml
--config examples/custom_rollout_backend.yaml``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.prefix import MIN_SHARED_PREFIX


class SnapshotRolloutEngine(RolloutEngine):
    """:class:`~lightning_memrl.rollout.hf.RolloutEngine` over a frozen copy of ``model`` that
    :meth:`sync_weights` refreshes.

    For a policy in one process (no sharding). Generation, log-probs and shared-prefix prefill are
    the parent's; only the weights it samples with are its own.

    Args:
        model: the policy; copied, the copy is what generates.
        tokenizer: its tokenizer.
        share_prefixes: prefill a prompt prefix shared by group members once.
        min_shared_prefix: shortest shared prefix, in tokens, worth a separate prefill.
    """

    def __init__(
        self, model: Any, tokenizer: Any, share_prefixes: bool = True, min_shared_prefix: int = MIN_SHARED_PREFIX
    ) -> None:
        sampler = copy.deepcopy(model).eval().requires_grad_(False)
        super().__init__(sampler, tokenizer, share_prefixes=share_prefixes, min_shared_prefix=min_shared_prefix)
        self.synced_steps = 0  # how many times new weights arrived

    @torch.no_grad()
    def sync_weights(self, model: Any) -> None:
        """Copy ``model``'s weights (and device) into the sampling copy."""
        self.model.load_state_dict(model.state_dict())
        self.model.to(next(model.parameters()).device)
        self.synced_steps += 1
