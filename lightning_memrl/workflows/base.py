"""The workflow base: how a task becomes a trajectory of turns, run for every trajectory of a step in lockstep.

Each turn is one batched ``generate`` over all conversations that are still running. Paradigms
(MemAgent's overwritten text memory, a memory bank with operations, retrieval) subclass
:class:`Workflow`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import RolloutBatch, Task, Trajectory


def encode_chat_prompt(text: str, tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """Prompt ids of one user message (through the chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Workflow:
    """How tasks are turned into trajectories. Subclass and implement :meth:`rollout`.

    A workflow whose agents are not all trained (e.g. Memory-R1's answer agent while its manager
    trains) returns True from :meth:`needs_frozen_model`; ``MemRLModule`` then sets
    :attr:`frozen_engine`, a :class:`~lightning_memrl.rollout.hf.RolloutEngine` over a model that
    never trains (the LoRA base with adapters disabled, else a frozen copy of the initial
    weights), and the frozen agents' turns generate with it. ``memory_per_chunk`` says whether
    memory turn ``k`` writes ``trajectory.memories[k]`` after reading ``trajectory.chunks[k]``
    (what ``MemoryTokenCredit`` needs).
    """

    frozen_engine: RolloutEngine | None = None  # set by MemRLModule when needs_frozen_model()
    memory_per_chunk: bool = False  # each memory turn writes trajectory.memories[k] after reading chunks[k]

    def needs_frozen_model(self) -> bool:
        """True when some agents must generate with a fixed model while the policy trains."""
        return False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. in a checkpoint's hyper-parameters) without ``frozen_engine``, which holds a model."""
        state = self.__dict__.copy()
        state.pop("frozen_engine", None)
        return state

    def rollout(self, engine: RolloutEngine, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        """Run one trajectory per entry of ``tasks`` (group members are repeated entries)."""
        raise NotImplementedError

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        """Longest response any turn may generate (the constant of Dr. GRPO's normaliser)."""
        return settings.max_new_tokens

    def state_dict(self) -> dict[str, Any]:
        """State saved in checkpoints (e.g. a memory store)."""
        return {}

    module_lr: float | None = None  # learning rate of torch_modules' parameters (None: the policy's)

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        """Trainable modules of the workflow (e.g. a reranker); ``MemRLModule`` registers them, so
        their parameters reach the optimizer (lr ``module_lr``) and the checkpoint."""
        return {}

    def module_loss(self, rollouts: RolloutBatch) -> Tensor | None:
        """A loss for :meth:`torch_modules` from the last training rollout, or None; ``MemRLModule``
        backpropagates it, so its gradients join the policy's first optimizer step."""
        return None

    def step_metrics(self, rollouts: RolloutBatch) -> dict[str, float]:
        """Numbers about the last training rollout, only logged (as ``train/<name>``), never trained on."""
        return {}

    def evaluation_metrics(self, trajectory: Trajectory) -> dict[str, float | None]:
        """Extra per-task numbers for the evaluation report (e.g. evidence recall)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
