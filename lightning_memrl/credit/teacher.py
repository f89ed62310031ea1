"""The teacher: log-likelihood of the gold answer given a memory, under the frozen reference model.

Several credit methods (potential-based turn shaping, information gain, attribution) ask one
question of a memory: how likely does it make the gold answer? They ask it of the *teacher*, a
model that does not train: the LoRA policy with its adapters disabled, else the module's
reference (a frozen copy of the initial weights; loaded here once when the run has none, i.e.
``kl_coef: 0`` without LoRA). Scoring is teacher forcing, batched and micro-batched by
``grpo.micro_batch_tokens``, with no generation: the gold answer's ids are scored after the
workflow's answer prompt with the memory filled in, through the learner's own
``sequence_logprobs`` (so logits are divided by the sampling temperature, as the learner scores
the policy, and a group's shared prompt prefix is computed once).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.memory_turns import require_memory_per_chunk
from lightning_memrl.errors import ConfigError
from lightning_memrl.learner import micro_batches
from lightning_memrl.types import Task
from lightning_memrl.workflows.base import encode_chat_prompt

DEFAULT_ANSWER_FORMAT = "\\boxed{{{answer}}}"
"""How the gold answer is written as the answer turn's completion (the answer template asks for a box)."""


@dataclass
class AnswerScores:
    """Teacher log-likelihoods of a batch of answers.

    Attributes:
        total: summed log-likelihood of each answer.  # [B]
        per_token: each answer token's log-likelihood, 0 on padding.  # [B, A]
        mask: 1 on answer tokens.  # [B, A]
    """

    total: Tensor
    per_token: Tensor
    mask: Tensor

    @property
    def mean(self) -> Tensor:  # [B]
        """Per-token (length-normalised) log-likelihood of each answer."""
        return self.total / self.mask.sum(-1).clamp(min=1)


class AnswerPrompts:
    """Teacher inputs for a per-chunk-memory workflow: the answer prompt with a memory, and the gold answer.

    Args:
        workflow: a workflow with ``answer_template`` (``{problem}``, ``{memory}``), ``system_prompt``
            and ``memory.empty_text`` (MemAgent).
        tokenizer: the policy's tokenizer.
        answer_format: the gold answer as the answer turn would write it; ``{answer}`` is the task's
            first gold answer.
    """

    def __init__(self, workflow: Any, tokenizer: Any, answer_format: str = DEFAULT_ANSWER_FORMAT) -> None:
        self.workflow, self.tokenizer, self.answer_format = workflow, tokenizer, answer_format
        memory = getattr(workflow, "memory", None)
        self.empty_memory: str = getattr(memory, "empty_text", "")

    def prompt(self, question: str, memory: str) -> list[int]:
        """Prompt ids of the answer turn reading ``memory`` (empty text: what the workflow shows instead)."""
        text = self.workflow.answer_template.format(problem=question, memory=memory or self.empty_memory)
        return encode_chat_prompt(text, self.tokenizer, getattr(self.workflow, "system_prompt", None))

    def prompt_with_span(self, question: str, memory: str) -> tuple[list[int], int, int]:
        """:meth:`prompt` and the ``[start, end)`` positions of the memory's tokens in it.

        Found against the prompt with a blank memory: the tokens both share at the start and at the
        end are the template's, the rest the memory's (a token merged across the memory's edge
        counts as memory).
        """
        ids = self.prompt(question, memory)
        text = self.workflow.answer_template.format(problem=question, memory="")
        blank = encode_chat_prompt(text, self.tokenizer, getattr(self.workflow, "system_prompt", None))
        limit = min(len(ids), len(blank))
        start = next((i for i in range(limit) if ids[i] != blank[i]), limit)
        tail = next((i for i in range(limit - start) if ids[-1 - i] != blank[-1 - i]), limit - start)
        return ids, start, len(ids) - tail

    def answer(self, task: Task) -> list[int]:
        """Ids of the task's first gold answer written with ``answer_format``."""
        if not task.answers or not task.answers[0].strip():
            raise ValueError(f"task {task.id!r} has no gold answer to score (answers: {task.answers!r})")
        ids = self.tokenizer(self.answer_format.format(answer=task.answers[0]), add_special_tokens=False)["input_ids"]
        return list(ids)


@contextmanager
def teacher_model(module: Any) -> Iterator[Any]:
    """The teacher in eval mode: the LoRA policy with adapters disabled, else the reference copy.

    A run without a reference (no LoRA and ``kl_coef: 0``) gets one here, loaded once and kept as
    the module's ``_reference`` (out of checkpoints, like the one ``configure_model`` loads).
    """
    policy = module.policy
    was_training = policy.training
    policy.eval()
    try:
        if module.lora is not None:
            with module.reference_context():
                yield policy
        else:
            if module._reference is None:
                mesh = module._device_mesh["data_parallel"] if module._device_mesh is not None else None
                reference = module._load_model(mesh, reference=True).eval().requires_grad_(False)
                module.__dict__["_reference"] = reference
            module._reference.to(module.device)
            yield module._reference
    finally:
        policy.train(was_training)


def right_pad(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids and their mask, [B, A]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def score_answers(
    module: Any, prompts: list[list[int]], answers: list[list[int]], token_budget: int | None = None
) -> AnswerScores:
    """Teacher log-likelihood of ``answers[i]`` after ``prompts[i]``, batched, without gradients.

    Identical (prompt, answer) pairs are scored once. Rows go through ``module.sequence_logprobs``
    in micro-batches of at most ``token_budget`` padded tokens (default ``grpo.micro_batch_tokens``).

    Args:
        module: the ``MemRLModule`` (its policy, reference, LoRA flag and learner settings).
        prompts: prompt ids per row.
        answers: answer ids per row, each non-empty.

    Returns:
        The summed and per-token log-likelihoods (:class:`AnswerScores`).
    """
    keys = [(tuple(p), tuple(a)) for p, a in zip(prompts, answers)]
    unique = list(dict.fromkeys(keys))
    row_of = {key: i for i, key in enumerate(unique)}
    width = max(len(a) for a in answers)
    per_token = torch.zeros((len(unique), width))
    budget = token_budget or module.grpo.micro_batch_tokens
    with torch.no_grad(), teacher_model(module) as model:
        for idx in micro_batches([len(p) + len(a) for p, a in unique], budget):
            ids, mask = right_pad([list(unique[i][1]) for i in idx], module.engine.pad_id)
            logprobs, _ = module.sequence_logprobs(model, [list(unique[i][0]) for i in idx], ids, mask)
            per_token[idx, : ids.shape[1]] = (logprobs.float() * mask.to(logprobs.device)).cpu()
    _, mask = right_pad([list(a) for _, a in unique], 0)
    rows = torch.tensor([row_of[k] for k in keys], dtype=torch.long)
    mask = mask[:, :width]
    return AnswerScores(per_token.sum(-1)[rows], per_token[rows], mask[rows])


class TeacherScoredCallback(MemRLCallback):
    """Shared part of the teacher-scored credit callbacks: the setup check, the prompts, the teacher's cost.

    Args:
        answer_format: the gold answer as the answer turn would write it (``{answer}``: the first gold answer).
    """

    method = "teacher"  # log prefix: train/<method>/...

    def __init__(self, answer_format: str = DEFAULT_ANSWER_FORMAT) -> None:
        if "{answer}" not in answer_format:
            raise ConfigError(f"{type(self).__name__}: answer_format must contain {{answer}}, got {answer_format!r}")
        self.answer_format = answer_format
        self.teacher_seconds = 0.0  # this step's teacher time
        self.teacher_rows = 0  # this step's scored (prompt, answer) rows

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse a workflow without one memory text per chunk (see :func:`require_memory_per_chunk`)."""
        require_memory_per_chunk(
            type(self).__name__,
            getattr(pl_module, "workflow", None),
            "it scores the gold answer's log-likelihood given the memory a memory turn wrote (trajectory.memories[k]), "
            "filled into the workflow's answer_template",
            needs_answer_template=True,
        )

    def prompts(self, module: Any) -> AnswerPrompts:
        return AnswerPrompts(module.workflow, module.tokenizer, self.answer_format)

    def score_memories(self, module: Any, pairs: list[tuple[Task, str]]) -> AnswerScores:
        """Teacher log-likelihood of each task's gold answer given each memory (``""``: the empty memory)."""
        builder = self.prompts(module)
        start = time.perf_counter()
        scores = score_answers(
            module, [builder.prompt(t.question, m) for t, m in pairs], [builder.answer(t) for t, _ in pairs]
        )
        self.teacher_seconds, self.teacher_rows = time.perf_counter() - start, len(pairs)
        return scores

    def log_cost(self, module: Any, batch_size: int) -> None:
        """``train/<method>/teacher_seconds`` and ``teacher_rows`` of this step."""
        module.log(f"train/{self.method}/teacher_seconds", self.teacher_seconds, batch_size=batch_size)
        module.log(f"train/{self.method}/teacher_rows", float(self.teacher_rows), batch_size=batch_size)
