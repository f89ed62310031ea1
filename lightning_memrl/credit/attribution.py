"""Attribution credit: each memory write is credited with its tokens' gradient×input contribution to the
teacher's likelihood of the gold answer.

After AttriMem (attribution-based local rewards for memory contents; we found no arXiv id for it):
token-level attribution of the gold answer's log-likelihood back to the memory tokens it was
conditioned on, aggregated per memory write. Gradient×input (Shrikumar et al. 2016,
arXiv:1605.01713; Ancona et al. 2018, arXiv:1711.06104) is the attribution used here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_memrl import learner
from lightning_memrl.credit.memory_turns import check_one_memory_per_turn, grouped_zscore, memory_turn_rows
from lightning_memrl.credit.teacher import (
    DEFAULT_ANSWER_FORMAT,
    TeacherScoredCallback,
    right_pad,
    teacher_model,
)
from lightning_memrl.errors import ConfigError
from lightning_memrl.types import RolloutBatch


class _Unshared:
    """The module as ``learner.sequence_logprobs`` reads it, prefix sharing off: one embedding pass per row."""

    share_prefixes = False

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


@contextmanager
def _captured_embeddings(model: Any) -> Iterator[list[Tensor]]:
    """Input embeddings of every forward of ``model`` inside the block, as leaves that require grad."""
    captured: list[Tensor] = []

    def hook(_layer: Any, _inputs: Any, output: Tensor) -> Tensor:
        leaf = output.detach().requires_grad_(True)
        captured.append(leaf)
        return leaf

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def answer_attributions(
    module: Any,
    prompts: list[list[int]],
    answers: list[list[int]],
    spans: list[tuple[int, int]],
    token_budget: int | None = None,
) -> Tensor:
    """Gradient×input of each row's answer log-likelihood, summed over the prompt tokens ``spans[i]``.

    ``a_i = Σ_{t ∈ span_i} ⟨∂ log p_teacher(answer_i | prompt_i) / ∂e_t, e_t⟩`` with ``e_t`` the input
    embedding of prompt token ``t``. One teacher forward and backward per micro-batch (``token_budget``
    padded tokens, default ``grpo.micro_batch_tokens``); gradients are taken with respect to the
    embeddings only (``torch.autograd.grad``), so no parameter's ``.grad`` is touched.

    Returns:
        The attribution of each row, fp32.  # [B]
    """
    out = torch.zeros(len(prompts))
    budget = token_budget or module.grpo.micro_batch_tokens
    unshared = _Unshared(module)
    with teacher_model(module) as model, torch.enable_grad(), _captured_embeddings(model) as captured:
        for idx in learner.micro_batches([len(prompts[i]) + len(answers[i]) for i in range(len(prompts))], budget):
            captured.clear()
            ids, mask = right_pad([answers[i] for i in idx], module.engine.pad_id)
            batch_prompts = [prompts[i] for i in idx]
            logprobs, _ = learner.sequence_logprobs(unshared, model, batch_prompts, ids, mask)
            total = (logprobs.float() * mask.to(logprobs.device)).sum()
            (embeddings,) = captured  # [b, P+R, H]
            (grad,) = torch.autograd.grad(total, embeddings)
            contribution = (grad.float() * embeddings.detach().float()).sum(-1).cpu()  # [b, P+R]
            width = max(len(p) for p in batch_prompts)  # prompts are left-padded to this width
            for r, i in enumerate(idx):
                offset = width - len(prompts[i])
                start, end = spans[i]
                out[i] = contribution[r, offset + start : offset + end].sum()
    return out


class AttributionCredit(TeacherScoredCallback):
    """Attribution credit of MemAgent's memory writes (a ``MemRLCallback``, ``on_advantages``).

    As implemented, for memory turn ``k`` of trajectory ``i``, which wrote memory ``m_k``:

    - ``a_{i,k} = Σ_{t ∈ m_k} ⟨∇_{e_t} log p_teacher(y | answer_prompt(q, m_k)), e_t⟩``: gradient×input
      of the gold answer's summed log-likelihood with respect to the input embeddings of ``m_k``'s
      tokens in the answer prompt (``aggregation: mean`` divides by the number of those tokens).
      The teacher is the frozen reference; every memory of the batch is one row of one batched
      teacher forward and backward (:func:`answer_attributions`), no generation, no parameter grads.
    - ``â_{i,k}`` = ``a_{i,k}`` z-scored over all trained memory turns of the group (unbiased std).
    - Tokens of memory turn ``k``: ``A = A_out + weight · â_{i,k}``: a local credit on that turn's
      advantage, not on the trajectory reward (which ``turn_rewards`` would be summed into before
      the group advantage, and so not stay local). Answer turns keep ``A_out``.

    Args:
        weight: scale of the normalised attribution added to the memory turns' advantages.
        aggregation: ``sum`` or ``mean`` of the token attributions of a memory.
        answer_format: the gold answer as the answer turn writes it.
        eps: added to the std of the normalisation.

    Keeps no state between steps (nothing to checkpoint). Refused at setup for a workflow without
    one memory text per chunk (a memory-bank workflow).

    Logs ``train/attribution/score`` (mean ``a``), ``train/attribution/teacher_seconds`` and
    ``train/attribution/teacher_rows``.
    """

    method = "attribution"

    def __init__(
        self,
        weight: float = 0.1,
        aggregation: str = "sum",
        answer_format: str = DEFAULT_ANSWER_FORMAT,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(answer_format)
        if weight < 0:
            raise ConfigError(f"AttributionCredit: weight must be >= 0, got {weight}")
        if aggregation not in ("sum", "mean"):
            raise ConfigError(f"AttributionCredit: aggregation must be 'sum' or 'mean', got {aggregation!r}")
        self.weight, self.aggregation, self.eps = weight, aggregation, eps

    def memory_attributions(self, module: Any, items: list[tuple[Any, str]]) -> Tensor:
        """``a`` of each (task, memory) pair, from one batched teacher forward and backward."""
        builder = self.prompts(module)
        prompts, spans = [], []
        for task, memory in items:
            ids, start, end = builder.prompt_with_span(task.question, memory)
            prompts.append(ids)
            spans.append((start, end))
        clock = time.perf_counter()
        scores = answer_attributions(module, prompts, [builder.answer(t) for t, _ in items], spans)
        self.teacher_seconds, self.teacher_rows = time.perf_counter() - clock, len(items)
        if self.aggregation == "mean":
            scores = scores / torch.tensor([max(e - s, 1) for s, e in spans], dtype=scores.dtype)
        return scores

    def on_advantages(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        check_one_memory_per_turn(rollouts, "AttributionCredit")
        rows = memory_turn_rows(rollouts)
        items, targets, keys = [], [], []
        for i, (trajectory, trajectory_rows) in enumerate(zip(rollouts.trajectories, rows)):
            for memory, row in zip(trajectory.memories, trajectory_rows):
                if row is not None:
                    items.append((trajectory.task, memory))
                    targets.append(row)
                    keys.append(i // rollouts.group_size)
        n = rollouts.num_trajectories
        if not items:
            self.teacher_seconds, self.teacher_rows = 0.0, 0
            self.log_cost(module, n)
            return
        scores = self.memory_attributions(module, items)
        credit = grouped_zscore(scores, keys, self.eps)
        bonus = torch.zeros(rollouts.advantages.shape[0])
        bonus[targets] = self.weight * credit
        mask = rollouts.response_mask.to(rollouts.advantages.dtype)
        rollouts.advantages = rollouts.advantages + bonus.unsqueeze(-1).to(rollouts.advantages) * mask
        module.log("train/attribution/score", float(scores.mean()), batch_size=n)
        self.log_cost(module, n)
