"""A user-written workflow, chosen from YAML: append-only notes instead of an overwritten memory.

MemAgent rewrites its whole memory after every chunk and may drop a fact it needs later. Here each
chunk adds one line of notes and nothing is ever dropped; the answer turn reads every line. The
notes after chunk ``k`` are ``trajectory.memories[k]``, so memory callbacks (``MemoryTokenCredit``)
and memory-aware rewards work with it unchanged.

Use it with ``PYTHONPATH=examples lightning-memrl fit --config configs/memagent/tiny.yaml --config
examples/custom_workflow.yaml``.
"""

from __future__ import annotations

from lightning_memrl.errors import check_placeholders
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

NOTE_TEMPLATE = (
    "Question: {problem}\n\nSection:\n{chunk}\n\n"
    "Write one short line of notes: the fact of this section that helps answer the question, or 'nothing'."
)

ANSWER_TEMPLATE = "Question: {problem}\n\nYour notes:\n{notes}\n\nAnswer as \\boxed{{answer}}."


class AppendNotesWorkflow(Workflow):
    """Read chunk k, append one line of notes, answer from all lines.

    Args:
        note_tokens: generation cap of a note turn (one line).
        chunk_tokens: chunk size when a task's context is one text (ignored for chunk lists).
        max_chunks: read at most this many chunks (null: all); the rest are dropped and counted.
        note_template: prompt of a note turn, with ``{problem}`` and ``{chunk}``.
        answer_template: prompt of the answer turn, with ``{problem}`` and ``{notes}``.
    """

    memory_per_chunk = True  # memories[k] is written after reading chunks[k]

    def __init__(
        self,
        note_tokens: int = 16,
        chunk_tokens: int = 256,
        max_chunks: int | None = None,
        note_template: str = NOTE_TEMPLATE,
        answer_template: str = ANSWER_TEMPLATE,
    ) -> None:
        check_placeholders(
            ("note_template", note_template, ("{problem}", "{chunk}")),
            ("answer_template", answer_template, ("{problem}", "{notes}")),
        )
        self.note_tokens, self.chunk_tokens, self.max_chunks = note_tokens, chunk_tokens, max_chunks
        self.note_template, self.answer_template = note_template, answer_template

    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        tokenizer = engine.tokenizer
        trajectories = chunked_trajectories(tasks, tokenizer, self.chunk_tokens, self.max_chunks)
        for k in range(max(len(t.chunks) for t in trajectories)):
            running = [t for t in trajectories if k < len(t.chunks)]
            texts = [self.note_template.format(problem=t.task.question, chunk=t.chunks[k]) for t in running]
            prompts = [encode_chat_prompt(text, tokenizer) for text in texts]
            generations = generate_in_lockstep(engine, running, prompts, settings, self.note_tokens)
            for trajectory, prompt, gen in zip(running, prompts, generations):
                line = " ".join(tokenizer.decode(gen.token_ids, skip_special_tokens=True).split())  # one line
                trajectory.turns.append(Turn(MEMORY_TURN, prompt, gen, line))
                trajectory.memories.append("\n".join(turn.text for turn in trajectory.turns))  # every line so far
        texts = [
            self.answer_template.format(problem=t.task.question, notes=t.memories[-1] if t.memories else "")
            for t in trajectories
        ]
        append_answer_turns(engine, trajectories, [encode_chat_prompt(text, tokenizer) for text in texts], settings)
        return trajectories

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        return max(settings.max_new_tokens, self.note_tokens)
