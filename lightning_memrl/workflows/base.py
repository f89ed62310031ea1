"""The workflow base: how a task becomes a trajectory of turns, run for every trajectory of a step in lockstep.

Each turn is one batched ``generate`` over all conversations that are still running. Paradigms
(MemAgent's overwritten text memory, a memory bank with operations, retrieval) subclass
:class:`Workflow`. A workflow that reads a context chunk by chunk builds on :func:`chunked_trajectories`
(the chunks each trajectory reads), :func:`generate_in_lockstep` (one turn of every running
trajectory, group members sharing their prompt prefix) and :func:`append_answer_turns`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, Generation, RolloutBatch, Task, Trajectory, Turn

log = logging.getLogger(__name__)


def encode_chat_prompt(text: str, tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """Prompt ids of one user message (through the chat template when the tokenizer has one)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def split_context(context: list[str] | str, tokenizer: Any, chunk_tokens: int) -> list[str]:
    """A chunk list as is (blank chunks left out); one text cut into windows of ``chunk_tokens`` tokens."""
    if isinstance(context, list):
        return [c for c in context if c.strip()]
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[i : i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]


def chunked_trajectories(
    tasks: list[Task], tokenizer: Any, chunk_tokens: int, max_chunks: int | None = None
) -> list[Trajectory]:
    """One empty trajectory per task holding the chunks it will read (:func:`split_context`).

    Group members share their ``Task`` object, which is chunked once. Chunks beyond ``max_chunks``
    (None: no limit) are dropped, counted in ``Trajectory.chunks_dropped`` and logged.
    """
    chunk_cache: dict[int, list[str]] = {}
    trajectories = []
    for task in tasks:
        if id(task) not in chunk_cache:
            chunk_cache[id(task)] = split_context(task.context, tokenizer, chunk_tokens)
        chunks = chunk_cache[id(task)]
        kept = chunks[:max_chunks] if max_chunks else chunks
        trajectories.append(Trajectory(task=task, chunks=kept, chunks_dropped=len(chunks) - len(kept)))
    dropped = sum(t.chunks_dropped for t in trajectories)
    if dropped:
        log.warning("max_chunks=%s: dropped %d chunks across %d trajectories", max_chunks, dropped, len(tasks))
    return trajectories


def generate_in_lockstep(
    engine: RolloutBackend,
    trajectories: list[Trajectory],
    prompts: list[list[int]],
    settings: GenerationSettings,
    max_new_tokens: int | None = None,
) -> list[Generation]:
    """One batched ``generate``: ``prompts[i]`` continues ``trajectories[i]``.

    Group members (the same ``Task`` object) share a prefix label, so the prompt prefix they share
    (problem, chunk) is prefilled once; a too-long prompt is reported with its task id.
    """
    return engine.generate(
        prompts,
        settings,
        max_new_tokens=max_new_tokens,
        prefix_labels=[id(t.task) for t in trajectories],
        task_ids=[t.task.id for t in trajectories],
    )


def append_answer_turns(
    engine: RolloutBackend, trajectories: list[Trajectory], prompts: list[list[int]], settings: GenerationSettings
) -> None:
    """Generate every trajectory's answer to its prompt and append it as its last turn (``ANSWER_TURN``)."""
    generations = generate_in_lockstep(engine, trajectories, prompts, settings)
    for trajectory, prompt, gen in zip(trajectories, prompts, generations):
        text = engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        trajectory.turns.append(Turn(ANSWER_TURN, prompt, gen, text))


class Workflow:
    """How tasks are turned into trajectories. Subclass and implement :meth:`rollout`.

    A workflow whose agents are not all trained (e.g. Memory-R1's answer agent while its manager
    trains) returns True from :meth:`needs_frozen_model`; ``MemRLModule`` then sets
    :attr:`frozen_engine`, a :class:`~lightning_memrl.rollout.base.RolloutBackend` over a model that
    never trains (the LoRA base with adapters disabled, else a frozen copy of the initial
    weights), and the frozen agents' turns generate with it. ``memory_per_chunk`` says whether
    memory turn ``k`` writes ``trajectory.memories[k]`` after reading ``trajectory.chunks[k]``
    (what ``MemoryTokenCredit`` needs); ``records_memory_writes`` whether each memory turn notes the
    bank entries it wrote in ``turn.info["wrote_entries"]`` (what ``FineMemCredit`` needs on a bank).
    """

    frozen_engine: RolloutBackend | None = None  # set by MemRLModule when needs_frozen_model()
    memory_per_chunk: bool = False  # each memory turn writes trajectory.memories[k] after reading chunks[k]
    records_memory_writes: bool = False  # each memory turn notes turn.info["wrote_entries"] = {entry id: text}

    def needs_frozen_model(self) -> bool:
        """True when some agents must generate with a fixed model while the policy trains."""
        return False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. in a checkpoint's hyper-parameters) without ``frozen_engine``, which holds a model."""
        state = self.__dict__.copy()
        state.pop("frozen_engine", None)
        return state

    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
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

    def prepare_evaluation(self, trajectories: list[Trajectory]) -> None:
        """Called with an evaluation batch before :meth:`evaluation_metrics` of each (e.g. to judge them at once)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
