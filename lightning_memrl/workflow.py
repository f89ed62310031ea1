"""Agent workflows: how a task becomes a trajectory of turns, and the batch the update sees.

A workflow runs every trajectory of a step in lockstep, so each turn is one batched ``generate``
over all conversations that are still running. ``MemAgentWorkflow`` reads a long context chunk
by chunk, overwrites a bounded memory after each chunk, and answers from the memory alone.
Other paradigms (a memory bank with operations, retrieval) subclass :class:`Workflow`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_memrl.data import Task
from lightning_memrl.errors import check_option
from lightning_memrl.memory import TextMemoryStore
from lightning_memrl.rollout import Generation, GenerationSettings, RolloutEngine

log = logging.getLogger(__name__)

MEMORY_TURN = "memory"
ANSWER_TURN = "answer"

DEFAULT_MEMORY_TEMPLATE = (
    "You read a long document one section at a time and keep notes for a question.\n"
    "Question: {problem}\n\nSection:\n{chunk}\n\nYour notes so far:\n{memory}\n\n"
    "Write the updated notes: keep every fact that helps answer the question, add the new ones "
    "from this section, drop the rest. Reply with the notes only."
)
DEFAULT_ANSWER_TEMPLATE = (
    "Question: {problem}\n\nYour notes:\n{memory}\n\n"
    "Answer the question using the notes. Give the final answer as \\boxed{{answer}}."
)


def check_placeholders(*templates: tuple[str, str, tuple[str, ...]], owner: str = "workflow") -> None:
    """Stop on a prompt template that lacks a placeholder its owner fills in.

    Args:
        templates: ``(option name, template, required placeholders)`` per template.
        owner: what the options belong to, first word of the error message.
    """
    for name, template, keys in templates:
        missing = [k for k in keys if k not in template]
        if missing:
            raise ValueError(f"{owner} {name} lacks the placeholders {missing}")


@dataclass
class Turn:
    """One conversation of a trajectory: the exact prompt and generated token ids."""

    kind: str  # MEMORY_TURN or ANSWER_TURN (or a workflow's own kind, e.g. "extract")
    prompt_ids: list[int]
    generation: Generation
    text: str = ""  # decoded response (for rewards and logs only; never re-tokenised)
    trainable: bool = True  # False: a frozen agent's turn, left out of the update (no loss)
    reward: float = 0.0  # per-turn reward (e.g. a format penalty), summed into the trajectory's


@dataclass
class Trajectory:
    """All turns one group member produced for one task."""

    task: Task
    turns: list[Turn] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)  # memory text after each memory turn
    chunks: list[str] = field(default_factory=list)  # the chunks the agent read, in order
    chunks_dropped: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # workflow extras (retrieved ids, op counts, ...)

    @property
    def final_text(self) -> str:
        """Decoded response of the last turn (the answer)."""
        return self.turns[-1].text if self.turns else ""


@dataclass
class RolloutBatch:
    """Trajectories of one step and their turns flattened for the update.

    Per-trajectory fields have ``N`` rows (``num_tasks * group_size``, groups contiguous); per-turn
    fields have ``M`` rows. Callbacks may change ``rewards`` and ``turn_rewards`` in
    ``on_rewards`` and ``advantages`` in ``on_advantages``.
    """

    trajectories: list[Trajectory]
    group_size: int
    prompt_ids: list[list[int]]  # M prompts
    response_ids: Tensor  # [M, T] right-padded generated ids
    response_mask: Tensor  # [M, T] 1 on generated tokens
    rollout_logprobs: Tensor  # [M, T] sampling log-probs from the engine
    turn_to_trajectory: Tensor  # [M] long
    memory_tokens_mask: Tensor  # [M] bool: turn writes memory (else it answers)
    truncated: Tensor  # [M] bool
    rewards: Tensor = field(default_factory=lambda: torch.empty(0))  # [N]
    reward_components: dict[str, Tensor] = field(default_factory=dict)  # name -> [N]
    turn_rewards: Tensor = field(default_factory=lambda: torch.empty(0))  # [M], summed into rewards
    trajectory_advantages: Tensor = field(default_factory=lambda: torch.empty(0))  # [N]
    advantages: Tensor = field(default_factory=lambda: torch.empty(0))  # [M, T]

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], group_size: int, pad_id: int) -> RolloutBatch:
        """Flatten the trainable turns of ``trajectories`` into padded tensors."""
        turns = [(i, t) for i, traj in enumerate(trajectories) for t in traj.turns if t.trainable]
        width = max((len(t.generation.token_ids) for _, t in turns), default=1) or 1
        num_turns = len(turns)
        response_ids = torch.full((num_turns, width), pad_id, dtype=torch.long)
        response_mask = torch.zeros((num_turns, width), dtype=torch.long)
        logprobs = torch.zeros((num_turns, width))
        for row, (_, turn) in enumerate(turns):
            n = len(turn.generation.token_ids)
            response_ids[row, :n] = torch.tensor(turn.generation.token_ids, dtype=torch.long)
            response_mask[row, :n] = 1
            logprobs[row, :n] = turn.generation.logprobs
        return cls(
            trajectories=trajectories,
            group_size=group_size,
            prompt_ids=[t.prompt_ids for _, t in turns],
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=logprobs,
            turn_to_trajectory=torch.tensor([i for i, _ in turns], dtype=torch.long),
            memory_tokens_mask=torch.tensor([t.kind == MEMORY_TURN for _, t in turns], dtype=torch.bool),
            truncated=torch.tensor([t.generation.truncated for _, t in turns], dtype=torch.bool),
            turn_rewards=torch.tensor([float(t.reward) for _, t in turns]),
        )

    @property
    def num_trajectories(self) -> int:
        return len(self.trajectories)

    def with_placeholder_row(self, pad_id: int) -> RolloutBatch:
        """A copy holding one zero-advantage row (one pad token) instead of its turns.

        Under sharding every rank must run the same forward/backward passes; a rank without a
        trainable turn runs this row, its loss scaled by zero, to join the other ranks' passes.
        """
        return replace(
            self,
            prompt_ids=[[pad_id]],
            response_ids=torch.full((1, 1), pad_id, dtype=torch.long),
            response_mask=torch.ones((1, 1), dtype=torch.long),
            rollout_logprobs=torch.zeros((1, 1)),
            turn_to_trajectory=torch.zeros(1, dtype=torch.long),
            memory_tokens_mask=torch.zeros(1, dtype=torch.bool),
            truncated=torch.zeros(1, dtype=torch.bool),
            turn_rewards=torch.zeros(1),
            advantages=torch.zeros((1, 1)),
        )


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
    :attr:`frozen_engine`, a :class:`~lightning_memrl.rollout.RolloutEngine` over a model that
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

    def auxiliary_loss(self, rollouts: RolloutBatch) -> tuple[Tensor | None, dict[str, float]] | None:
        """A loss for :meth:`torch_modules` from the last training rollout (or None), with metrics to
        log (``train/<name>``); backpropagated before the policy's first optimizer step."""
        return None

    def evaluation_metrics(self, trajectory: Trajectory) -> dict[str, float | None]:
        """Extra per-task numbers for the evaluation report (e.g. evidence recall)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class MemAgentWorkflow(Workflow):
    """MemAgent: read chunk k with memory k-1, overwrite the memory, answer from the last memory.

    Args:
        max_memory_tokens: budget of the memory (also the generation cap of a memory turn).
        chunk_tokens: chunk size when a task's context is one text (ignored for chunk lists).
        max_chunks: read at most this many chunks; the rest are dropped and counted.
        memory_template: prompt of a memory turn, with ``{problem}``, ``{chunk}``, ``{memory}``
            (write literal braces as ``{{ }}``). The shared part (problem, chunk) comes first so
            group members share a prompt prefix.
        answer_template: prompt of the answer turn, with ``{problem}`` and ``{memory}``.
        system_prompt: optional system message of every turn.
        empty_memory: what the first turn shows as memory.
    """

    memory_per_chunk = True

    def __init__(
        self,
        max_memory_tokens: int = 64,
        chunk_tokens: int = 256,
        max_chunks: int | None = None,
        memory_template: str = DEFAULT_MEMORY_TEMPLATE,
        answer_template: str = DEFAULT_ANSWER_TEMPLATE,
        system_prompt: str | None = None,
        empty_memory: str = "No previous notes.",
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"workflow chunk_tokens must be >= 1, got {chunk_tokens}")
        if max_chunks is not None:
            check_option("model.init_args.workflow.init_args.max_chunks", max_chunks, 1, why="null reads every chunk")
        check_placeholders(
            ("memory_template", memory_template, ("{problem}", "{chunk}", "{memory}")),
            ("answer_template", answer_template, ("{problem}", "{memory}")),
        )
        self.memory = TextMemoryStore(max_memory_tokens, empty_text=empty_memory)
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks
        self.memory_template = memory_template
        self.answer_template = answer_template
        self.system_prompt = system_prompt

    def split_context(self, context: list[str] | str, tokenizer: Any) -> list[str]:
        """A chunk list as is; one text cut into windows of ``chunk_tokens`` tokens."""
        if isinstance(context, list):
            return [c for c in context if c.strip()]
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        return [tokenizer.decode(ids[i : i + self.chunk_tokens]) for i in range(0, len(ids), self.chunk_tokens)]

    def encode_prompt(self, text: str, tokenizer: Any) -> list[int]:
        """Prompt ids of one user message (through the chat template when there is one)."""
        return encode_chat_prompt(text, tokenizer, self.system_prompt)

    def rollout(self, engine: RolloutEngine, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        tokenizer = engine.tokenizer
        chunk_cache: dict[int, list[str]] = {}
        trajectories = []
        for task in tasks:  # group members share the Task object: chunk it once
            if id(task) not in chunk_cache:
                chunk_cache[id(task)] = self.split_context(task.context, tokenizer)
            chunks = chunk_cache[id(task)]
            kept = chunks[: self.max_chunks] if self.max_chunks else chunks
            trajectories.append(Trajectory(task=task, chunks=kept, chunks_dropped=len(chunks) - len(kept)))
        dropped = sum(t.chunks_dropped for t in trajectories)
        if dropped:
            log.warning("max_chunks=%s: dropped %d chunks across %d trajectories", self.max_chunks, dropped, len(tasks))
        self.memory.reset(len(trajectories))
        for k in range(max(len(t.chunks) for t in trajectories)):
            active = [i for i, t in enumerate(trajectories) if k < len(t.chunks)]
            prompts = [
                self.encode_prompt(
                    self.memory_template.format(
                        problem=trajectories[i].task.question,
                        chunk=trajectories[i].chunks[k],
                        memory=self.memory.read(i),
                    ),
                    tokenizer,
                )
                for i in active
            ]
            generations = engine.generate(  # group members share the problem and chunk: one prefill
                prompts,
                settings,
                max_new_tokens=self.memory.max_memory_tokens,
                prefix_labels=[id(trajectories[i].task) for i in active],
                task_ids=[trajectories[i].task.id for i in active],
            )
            for i, prompt, gen in zip(active, prompts, generations):
                text = self.memory.write(i, gen.token_ids, tokenizer)
                trajectories[i].turns.append(Turn(MEMORY_TURN, prompt, gen, text))
                trajectories[i].memories.append(text)
        prompts = [
            self.encode_prompt(
                self.answer_template.format(problem=t.task.question, memory=self.memory.read(i)), tokenizer
            )
            for i, t in enumerate(trajectories)
        ]
        labels, ids = [id(t.task) for t in trajectories], [t.task.id for t in trajectories]
        answers = engine.generate(prompts, settings, prefix_labels=labels, task_ids=ids)
        for traj, prompt, gen in zip(trajectories, prompts, answers):
            traj.turns.append(Turn(ANSWER_TURN, prompt, gen, tokenizer.decode(gen.token_ids, skip_special_tokens=True)))
        return trajectories

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        return max(settings.max_new_tokens, self.memory.max_memory_tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "memory" in state:
            self.memory.load_state_dict(state["memory"])
