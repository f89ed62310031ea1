"""The policy's generation mode: what a rollout switches on around the workflow, and restores after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from lightning_memrl import distributed


@contextmanager
def generation_mode(policy: Any, frozen: Any = None, device: torch.device | None = None) -> Iterator[None]:
    """The policy in eval mode with its KV cache on and, when sharded, gathered once for the block.

    Args:
        policy: the trained model; its ``training`` flag and ``config.use_cache`` are restored after.
        frozen: the model a workflow's frozen agents generate with (the reference), moved to
            ``device`` and gathered too; None when they have none of their own.
        device: where ``frozen`` must be.
    """
    was_training = policy.training
    policy.eval()
    use_cache = policy.config.use_cache
    policy.config.use_cache = True
    try:
        with ExitStack() as stack:
            stack.enter_context(distributed.unsharded_for_rollout(policy))  # sharded: gathered once
            if frozen is not None:
                frozen.to(device)
                stack.enter_context(distributed.unsharded_for_rollout(frozen))
            yield
    finally:
        policy.config.use_cache = use_cache
        policy.train(was_training)
