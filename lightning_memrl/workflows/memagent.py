"""MemAgent (arXiv:2507.02259): read a long context chunk by chunk, overwrite a bounded memory after
each chunk, and answer from the memory alone."""

from __future__ import annotations

from typing import Any

from lightning_memrl.errors import check_option, check_placeholders
from lightning_memrl.memory.text import TextMemoryStore
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import MEMORY_TURN, Task, Trajectory, Turn
from lightning_memrl.workflows.base import (
    Workflow,
    append_answer_turns,
    chunked_trajectories,
    encode_chat_prompt,
    generate_in_lockstep,
)

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

    def encode_prompt(self, text: str, tokenizer: Any) -> list[int]:
        """Prompt ids of one user message (through the chat template when there is one)."""
        return encode_chat_prompt(text, tokenizer, self.system_prompt)

    def memory_prompt(self, trajectory: Trajectory, k: int, memory: str, tokenizer: Any) -> list[int]:
        """Prompt ids of memory turn ``k`` of ``trajectory``: its chunk ``k`` with ``memory`` as the notes so far."""
        text = self.memory_template.format(problem=trajectory.task.question, chunk=trajectory.chunks[k], memory=memory)
        return self.encode_prompt(text, tokenizer)

    def reroll_memory_turn(
        self, engine: RolloutBackend, trajectory: Trajectory, k: int, n: int, settings: GenerationSettings
    ) -> list[Turn]:
        """Sample memory turn ``k`` of ``trajectory`` again ``n`` times from the same pre-write state.

        The state is what turn ``k`` read: memory ``m_{k-1}`` (``trajectory.memories[k-1]``, the empty
        memory for ``k = 0``) and chunk ``k``; the prompt is rebuilt and checked to equal the recorded
        ``turn.prompt_ids``. Each re-roll's ``text`` is the memory it would write (cut to the budget);
        neither the trajectory nor the workflow's memory store changes.

        Raises:
            ValueError: ``k`` is not a memory turn of ``trajectory``, or the rebuilt prompt differs from
                the recorded one (the trajectory was not written by this workflow's templates).
        """
        if not 0 <= k < len(trajectory.memories) or trajectory.turns[k].kind != MEMORY_TURN:
            raise ValueError(f"reroll_memory_turn: turn {k} of task {trajectory.task.id!r} is not a memory turn")
        tokenizer, empty = engine.tokenizer, self.memory.empty_text
        prompt = self.memory_prompt(trajectory, k, (trajectory.memories[k - 1] if k else "") or empty, tokenizer)
        if prompt != trajectory.turns[k].prompt_ids:
            raise ValueError(
                f"reroll_memory_turn: the rebuilt prompt of memory turn {k} (task {trajectory.task.id!r}) differs "
                "from the recorded one; re-roll trajectories of this workflow with its own templates"
            )
        scratch = TextMemoryStore(self.memory.max_memory_tokens, empty_text=empty)
        scratch.reset(1)
        generations = generate_in_lockstep(engine, [trajectory] * n, [prompt] * n, settings, scratch.max_memory_tokens)
        return [Turn(MEMORY_TURN, prompt, gen, scratch.write(0, gen.token_ids, tokenizer)) for gen in generations]

    def continue_rerolls(
        self, engine: RolloutBackend, trajectory: Trajectory, k: int, turns: list[Turn], settings: GenerationSettings
    ) -> list[Trajectory]:
        """One trajectory per turn of ``turns`` (re-rolls of memory turn ``k``): ``trajectory``'s first ``k``
        turns, the re-roll, then the remaining chunks read from the re-rolled memory and an answer.

        Neither ``trajectory`` nor the workflow's memory store changes.
        """
        store = TextMemoryStore(self.memory.max_memory_tokens, empty_text=self.memory.empty_text)
        store.reset(len(turns))
        continued = []
        for slot, turn in enumerate(turns):
            store.texts[slot] = turn.text
            continued.append(
                Trajectory(
                    task=trajectory.task,
                    turns=[*trajectory.turns[:k], turn],
                    memories=[*trajectory.memories[:k], turn.text],
                    chunks=trajectory.chunks,
                    chunks_dropped=trajectory.chunks_dropped,
                    info=dict(trajectory.info),
                )
            )
        return self._read_and_answer(engine, continued, store, settings)

    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        trajectories = chunked_trajectories(tasks, engine.tokenizer, self.chunk_tokens, self.max_chunks)
        self.memory.reset(len(trajectories))
        return self._read_and_answer(engine, trajectories, self.memory, settings)

    def _read_and_answer(
        self,
        engine: RolloutBackend,
        trajectories: list[Trajectory],
        store: TextMemoryStore,
        settings: GenerationSettings,
    ) -> list[Trajectory]:
        """Memory turns over each trajectory's chunks from its first unread one (``len(memories)``) on, with
        slot ``i`` of ``store`` as trajectory ``i``'s memory, then every trajectory's answer turn."""
        tokenizer = engine.tokenizer
        for k in range(max(len(t.chunks) for t in trajectories)):
            active = [i for i, t in enumerate(trajectories) if len(t.memories) <= k < len(t.chunks)]
            if not active:
                continue
            running = [trajectories[i] for i in active]
            prompts = [self.memory_prompt(trajectories[i], k, store.read(i), tokenizer) for i in active]
            generations = generate_in_lockstep(engine, running, prompts, settings, store.max_memory_tokens)
            for i, prompt, gen in zip(active, prompts, generations):
                text = store.write(i, gen.token_ids, tokenizer)
                trajectories[i].turns.append(Turn(MEMORY_TURN, prompt, gen, text))
                trajectories[i].memories.append(text)
        prompts = [
            self.encode_prompt(self.answer_template.format(problem=t.task.question, memory=store.read(i)), tokenizer)
            for i, t in enumerate(trajectories)
        ]
        append_answer_turns(engine, trajectories, prompts, settings)
        return trajectories

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        return max(settings.max_new_tokens, self.memory.max_memory_tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "memory" in state:
            self.memory.load_state_dict(state["memory"])
