"""The GRPO update: token-budgeted micro-batches, sequence log-probs (with shared prompt prefixes
computed once), the clipped policy loss, and ``ppo_epochs`` optimizer steps with their guards.

Functions take the LightningModule whose policy they train, typed by :class:`Trainee`: what they
read from it (``MemRLModule`` is one). They call its ``sequence_logprobs``, so a subclass's override
applies.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_memrl import adapter_groups, allocator, distributed, guards, losses
from lightning_memrl.logprobs import head_logprobs, selected_logprobs, split_head
from lightning_memrl.rewards import RewardFunction
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.prefix import (
    checkpoint_with_cache,
    left_pad,
    position_ids,
    prefill_shared_prefixes,
    replayable_cache,
    shared_prefix_groups,
    split_shared_prefixes,
)
from lightning_memrl.settings import GenerationSettings, GRPOSettings
from lightning_memrl.types import RolloutBatch
from lightning_memrl.workflows.base import Workflow

log = logging.getLogger(__name__)


class Trainee(Protocol):
    """What the update reads from the LightningModule that owns the policy (``MemRLModule`` is one)."""

    policy: Any  # the trained model
    _reference: Any  # frozen copy of the initial weights, or None (LoRA: the adapters switched off)
    engine: RolloutBackend
    grpo: GRPOSettings
    generation: GenerationSettings
    workflow: Workflow
    workflow_modules: torch.nn.ModuleDict  # the workflow's trainable modules
    share_prefixes: bool
    gradient_checkpointing: bool
    _skips: guards.SkipCounter  # consecutive skipped optimizer steps
    device: torch.device
    global_step: int

    def optimizers(self) -> Any: ...
    def lr_schedulers(self) -> Any: ...
    def manual_backward(self, loss: Tensor) -> None: ...
    def reference_context(self) -> AbstractContextManager[Any]: ...  # the policy as the reference (LoRA)

    sequence_logprobs: Callable[..., tuple[Tensor, Tensor | None]]  # this file's sequence_logprobs, or an override


def micro_batches(lengths: list[int], token_budget: int, rows: list[int] | None = None) -> list[list[int]]:
    """Split row indices (``rows``, default all) into micro-batches whose padded size stays within ``token_budget``.

    Rows are sorted by length so rows of similar length share a micro-batch (less padding). A row
    longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)) if rows is None else rows, key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * max(lengths[j] for j in current + [i]) > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def sequence_logprobs(
    module: Trainee,
    model: Any,
    prompts: list[list[int]],
    response_ids: Tensor,
    response_mask: Tensor,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``response_ids`` [B, R] after their prompts, under ``logits / temperature``.

    Rows are laid out ``[pad… prompt][response pad…]`` so every response ends inside the last
    ``R`` positions. Only those positions are scored, by the LM head in chunks
    (:func:`~lightning_memrl.logprobs.head_logprobs`): no full-vocabulary fp32 logits for the
    prompt or the whole micro-batch. Models whose head cannot be split off (sharded, adapted)
    get ``logits_to_keep`` instead.
    """
    device = module.device
    resp_len = response_ids.shape[1]
    prompt_ids, prompt_mask = left_pad(prompts, module.engine.pad_id)  # [B, P]
    width = prompt_ids.shape[1]
    attention = torch.cat([prompt_mask, response_mask.to(torch.long)], dim=1)
    inputs = {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1).to(device),
        "attention_mask": attention.to(device),
        "position_ids": position_ids(attention).to(device),
        "use_cache": False,
    }
    temperature = module.generation.temperature if module.generation.temperature > 0 else 1.0
    targets = response_ids.to(device)
    parts = split_head(model)
    groups = update_prefix_groups(module, prompts) if parts is not None else []
    if parts is not None:
        decoder, head = parts
        if groups:  # one prefix pass per group, its KV cache (and gradient) shared by the members
            hidden = shared_prefix_hidden(module, decoder, prompts, response_ids, response_mask, groups)
        else:
            hidden = decoder(**inputs).last_hidden_state[:, width - 1 : -1]  # [B, R, H]: t predicts token t
        logprobs, entropy = head_logprobs(
            hidden, head, targets, temperature, with_entropy, entropy_grad=module.grpo.entropy_coef != 0
        )
    else:
        logits = model(**inputs, logits_to_keep=resp_len + 1).logits[:, :-1]  # [B, R, V]
        logprobs = selected_logprobs(logits, targets, temperature)
        entropy = losses.entropy_from_logits(logits.float() / temperature) if with_entropy else None
    if entropy is not None and module.grpo.entropy_coef == 0:
        entropy = entropy.detach()  # a metric only
    return logprobs, entropy


def update_prefix_groups(module: Trainee, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Groups of rows whose prompts share a prefix, or ``[]`` when sharing is off or saves nothing."""
    if not module.share_prefixes:
        return []
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])  # equal prefixes side by side
    groups = shared_prefix_groups([prompts[i] for i in order], module.engine.min_shared_prefix)
    groups = [(length, [order[r] for r in rows]) for length, rows in groups]
    return groups if any(len(rows) > 1 for _, rows in groups) else []


def shared_prefix_hidden(
    module: Trainee,
    decoder: Any,
    prompts: list[list[int]],
    response_ids: Tensor,  # [B, R]
    response_mask: Tensor,  # [B, R]
    groups: list[tuple[int, list[int]]],
) -> Tensor:  # [B, R, H] hidden states that predict the response tokens
    """Decoder states for ``[prefix][rest of prompt][response]`` with each prefix computed once.

    Exact: a causal model's states over a shared prefix do not depend on what follows, so the
    prefix's keys and values are computed once per group and copied (by a differentiable
    index) to its members; the members' gradients flow back into that one computation. The
    cache answers a gradient-checkpointed layer's replay as it answered its forward.
    """
    device = module.device
    layout = split_shared_prefixes(prompts, groups, module.engine.pad_id, device)
    full_mask = torch.cat([layout.row_mask, response_mask.to(device)], dim=1)  # [B, P+S+R]
    prefix_width, rest_width = layout.prefix_ids.shape[1], layout.rest_ids.shape[1]
    with checkpoint_with_cache(decoder):
        cache = prefill_shared_prefixes(decoder, layout, cache=replayable_cache())
        hidden = decoder(
            input_ids=torch.cat([layout.rest_ids, response_ids.to(device)], dim=1),
            attention_mask=full_mask,
            position_ids=position_ids(full_mask)[:, prefix_width:],
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # [B, S+R, H]
    return hidden[:, rest_width - 1 : -1]


def update(module: Trainee, rollouts: RolloutBatch) -> dict[str, float]:
    """``ppo_epochs`` optimizer steps over token-budgeted micro-batches of the rollouts."""
    g = module.grpo
    opt = module.optimizers()
    scheduler = module.lr_schedulers()
    mask = rollouts.response_mask.bool()
    trained = losses.loss_mask(rollouts.response_mask, rollouts.truncated, g.mask_truncated_completions)
    weights = losses.loss_token_weights(
        trained,
        rollouts.turn_to_trajectory,
        g.loss_aggregation,
        module.workflow.max_response_tokens(module.generation),
    )
    lengths = [len(p) + int(n) for p, n in zip(rollouts.prompt_ids, rollouts.response_mask.sum(-1))]
    inert = losses.rows_without_gradient(g, rollouts.advantages, weights)  # [M]: no forward, no backward
    batches = micro_batches(lengths, g.micro_batch_tokens, [i for i, out in enumerate(inert.tolist()) if not out])
    passes = distributed.max_over_ranks(len(batches))
    if passes == 0 and not distributed.max_over_ranks(int(inert.any())):  # no trainable turn (only frozen agents spoke)
        _step(opt, scheduler)  # still one step: global_step advances, a workflow module's gradients apply
        module.engine.sync_weights(module.policy)
        return {"loss": 0.0, "grad_norm": 0.0, "reference_time": 0.0, "logprob_gap": 0.0, "micro_batches": 0.0}
    placeholder = not batches and passes > 0  # only this rank has nothing to train: zero-weight passes keep it in step
    if placeholder:
        rollouts, weights, batches = rollouts.with_placeholder_row(module.engine.pad_id), torch.zeros(1, 1), [[0]]
    batches, real_batches = distributed.equalize_micro_batches(batches)  # same pass count on every rank
    real_batches = 0 if placeholder else real_batches
    old_lp, ref_lp, ref_time = old_and_reference_logprobs(module, rollouts, batches)
    allocator.trim()
    sums: dict[str, float] = {}
    loss_total, grad_norm = 0.0, 0.0
    logprob_gap, skipped = 0.0, 0
    for epoch in range(g.ppo_epochs):
        epoch_loss, gap = epoch_backward(module, rollouts, weights, batches, real_batches, old_lp, ref_lp, sums, epoch)
        logprob_gap += gap
        loss_total += epoch_loss
        if passes == 0:  # every row skipped: the gradient the passes would have left, exactly zero
            zero_gradients(module.policy)
        grad_norm, skip = clip_gradients_or_skip(module, opt, epoch_loss)
        skipped += skip
        _step(opt, scheduler)  # after a skip no parameter has a gradient: AdamW changes no weight and no moment
        if not skip:  # the rollout backend samples the next batch from the new weights
            module.engine.sync_weights(module.policy)
    computed = max(float(mask[~inert].sum()), 1.0)  # the per-token metrics cover the rows the passes computed
    out = {key: value / (computed * g.ppo_epochs) for key, value in sums.items()}
    out.update(
        loss=loss_total / g.ppo_epochs,
        grad_norm=grad_norm,
        reference_time=ref_time,
        logprob_gap=logprob_gap / computed,
        micro_batches=float(len(batches)),
        skipped_steps=float(skipped),
        skipped_rows=float(inert.sum()),
        skipped_tokens=float(mask[inert].sum()),
    )
    if g.mask_truncated_completions:  # the share of generated tokens that truncated turns kept out of the loss
        out["loss_variant/truncated_masked_frac"] = 1.0 - float(trained.sum()) / max(float(mask.sum()), 1.0)
    return out


def _step(opt: Any, scheduler: Any) -> None:
    """The optimizer step, its gradients cleared, and the LR scheduler's step."""
    opt.step()
    opt.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()


def zero_gradients(model: Any) -> None:
    """Give every trainable parameter without a gradient a zero one, as a backward pass of a zero loss would."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _rows(rollouts: RolloutBatch, idx: list[int]) -> tuple[list[list[int]], Tensor, Tensor]:
    """Prompts, response ids and response mask of the rows ``idx``, trimmed to their longest response."""
    width = int(rollouts.response_mask[idx].sum(-1).max())  # trim shared padding
    return (
        [rollouts.prompt_ids[i] for i in idx],
        rollouts.response_ids[idx, :width],
        rollouts.response_mask[idx, :width],
    )


def old_and_reference_logprobs(
    module: Trainee, rollouts: RolloutBatch, batches: list[list[int]]
) -> tuple[dict[int, Tensor], dict[int, Tensor], float]:
    """Old (``ppo_epochs > 1``) and reference (``kl_coef > 0``) log-probs per micro-batch, without gradients.

    Returns:
        The old and the reference log-probs by micro-batch index, and the seconds they took.
    """
    g = module.grpo
    need_old = g.ppo_epochs > 1
    need_ref = g.kl_coef > 0
    old_lp: dict[int, Tensor] = {}
    ref_lp: dict[int, Tensor] = {}
    ref_time = 0.0
    if need_old or need_ref:
        start = time.perf_counter()
        was_training = module.policy.training
        module.policy.eval()  # old / reference log-probs without dropout noise
        with torch.no_grad():
            for b, idx in enumerate(batches):
                prompts, ids, m = _rows(rollouts, idx)
                if need_old:
                    old_lp[b] = module.sequence_logprobs(module.policy, prompts, ids, m)[0]
                if need_ref:
                    if module._reference is not None:
                        module._reference.to(module.device)
                        ref_lp[b] = module.sequence_logprobs(module._reference, prompts, ids, m)[0]
                    else:
                        with module.reference_context():
                            ref_lp[b] = module.sequence_logprobs(module.policy, prompts, ids, m)[0]
        module.policy.train(was_training)
        ref_time = time.perf_counter() - start
    return old_lp, ref_lp, ref_time


def epoch_backward(
    module: Trainee,
    rollouts: RolloutBatch,
    weights: Tensor,
    batches: list[list[int]],
    real_batches: int,
    old_lp: dict[int, Tensor],
    ref_lp: dict[int, Tensor],
    sums: dict[str, float],
    epoch: int,
) -> tuple[float, float]:
    """One epoch's forward and backward passes over the micro-batches; adds their metric sums to ``sums``.

    Micro-batches from ``real_batches`` on are repeats that only keep ranks in step: their loss is
    multiplied by 0. With one epoch the old log-probs are the detached current ones.

    Returns:
        The epoch's loss and (epoch 0 only, else 0) the summed absolute gap between the trainer's
        and the sampler's log-probs.
    """
    epoch_loss, logprob_gap = 0.0, 0.0
    with adapter_groups.grouped(module.policy):  # LoRA over a bf16 base: siblings share one fp32 input
        for b, idx in enumerate(batches):
            prompts, ids, m = _rows(rollouts, idx)
            width = ids.shape[1]
            logprobs, entropy = module.sequence_logprobs(module.policy, prompts, ids, m, with_entropy=True)
            allocator.trim(micro_batch=True)  # the logits chunks' temporaries, before the loss and backward allocate
            m_dev = m.to(module.device).bool()
            old = old_lp[b] if module.grpo.ppo_epochs > 1 else logprobs.detach()
            if epoch == 0 and b < real_batches:  # how far the trainer's log-probs are from the sampler's
                rollout_lp = rollouts.rollout_logprobs[idx, :width].to(module.device)
                logprob_gap += float(((logprobs.detach() - rollout_lp).abs() * m_dev).sum())
            loss, stats = losses.policy_loss(
                module.grpo,
                logprobs,
                old,
                ref_lp.get(b),
                rollouts.advantages[idx, :width].to(module.device),
                weights[idx, :width].to(module.device),
                entropy,
                m_dev,
            )
            if b >= real_batches:  # a repeat that only keeps ranks in step: no contribution
                loss, stats = loss * 0.0, {}
            module.manual_backward(loss)
            allocator.trim(micro_batch=True)  # the freed activations back to the system: RSS follows what is live
            epoch_loss += float(loss.detach())
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
    return epoch_loss, logprob_gap


def clip_gradients_or_skip(module: Trainee, opt: Any, loss: float) -> tuple[float, bool]:
    """Clip the policy's gradients to ``max_grad_norm``; drop them all when the step must be skipped.

    A step is skipped when its loss, its gradient norm or a workflow module's gradient is NaN
    or infinite on any rank. Every gradient is then set to None, so the ``opt.step()`` that
    follows changes no weight and no AdamW moment, while ``global_step`` and the LR scheduler
    still advance (as with a mixed-precision GradScaler's skipped step): ``max_steps`` counts
    attempted steps. ``max_consecutive_skipped_steps`` skipped in a row stop the run.

    Returns:
        The gradient norm before clipping (also when clipping is off) and whether the step is skipped.
    """
    params = [p for p in module.policy.parameters() if p.requires_grad]
    max_norm = module.grpo.max_grad_norm if module.grpo.max_grad_norm > 0 else math.inf  # inf: measure only
    grad_norm = distributed.clip_grad_norm(params, max_norm)
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    finite = finite and guards.grads_are_finite(module.workflow_modules.parameters())
    skip = bool(distributed.max_over_ranks(int(not finite)))  # every rank skips together
    if skip:
        opt.zero_grad(set_to_none=True)
        log.warning("step %d: loss %.4g, gradient norm %.4g: step skipped", module.global_step, loss, grad_norm)
    module._skips.record(skip, f"loss={loss:.4g}, grad_norm={grad_norm:.4g} at step {module.global_step}")
    return grad_norm, skip


def score_trajectories(
    reward_functions: list[RewardFunction], rollouts: RolloutBatch
) -> tuple[Tensor, dict[str, Tensor], int]:
    """The weighted reward sum [N], each function's rewards (name → [N]) and the number of non-finite rewards.

    A trajectory that every reward function leaves unscored (None) gets NaN; so does one for which
    a function returns NaN or ±inf (counted). A value that is not a number stops the run with an
    error naming the function.
    """
    components = {r.name: torch.full((rollouts.num_trajectories,), math.nan) for r in reward_functions}
    total = torch.full((rollouts.num_trajectories,), math.nan)
    nonfinite = torch.zeros(rollouts.num_trajectories, dtype=torch.bool)
    for i, trajectory in enumerate(rollouts.trajectories):
        for fn in reward_functions:
            owner = f"reward function {fn.name!r} ({type(fn).__name__})"
            value = guards.reward_value(fn(trajectory), owner)
            if value is None:
                continue
            weighted = fn.weight * value
            if not (math.isfinite(value) and math.isfinite(weighted)):
                nonfinite[i] = True
                continue
            components[fn.name][i] = value
            total[i] = (0.0 if math.isnan(total[i]) else total[i]) + weighted
    nonfinite |= torch.isinf(total)  # a float32 sum of finite values can overflow
    total = total.masked_fill(nonfinite, math.nan)
    return total, components, int(nonfinite.sum())
