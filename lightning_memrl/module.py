"""``MemRLModule``: the policy, its frozen reference and the memory workflow, trained by GRPO.

One training step (``training_step``):

(a) repeat each task ``group_size`` times → (b) :meth:`rollout` (the workflow's batched turns)
→ (c) :meth:`score` (weighted reward functions) → (d) callbacks' ``on_rewards`` → (e)
:meth:`compute_advantages` per trajectory, broadcast to every token of its turns → (f) callbacks'
``on_advantages`` → (g) :meth:`update`: ``ppo_epochs`` passes over token-budgeted micro-batches
of :meth:`policy_loss`, gradient clipping, optimizer and LR-scheduler steps → (h) metrics.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_memrl import distributed, grpo, guards
from lightning_memrl.data import Task
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.evaluation import bleu1
from lightning_memrl.frozen import FrozenRolloutEngine
from lightning_memrl.logprobs import head_logprobs, selected_logprobs, split_head
from lightning_memrl.models import LoraSettings, QuantizationSettings, load_policy, load_tokenizer
from lightning_memrl.rewards import (
    ExactMatch,
    RewardFunction,
    answer_from_completion,
    check_answer_pattern,
    exact_match,
    token_f1,
)
from lightning_memrl.rollout import (
    MIN_SHARED_PREFIX,
    GenerationSettings,
    RolloutEngine,
    left_pad,
    shared_prefix_groups,
)
from lightning_memrl.workflow import MemAgentWorkflow, RolloutBatch, Workflow

log = logging.getLogger(__name__)


@dataclass
class GRPOSettings:
    """GRPO options, named as TRL and verl users know them.

    Args:
        group_size: rollouts per task (``num_generations``).
        scale_rewards: ``group`` (GRPO), ``batch`` or ``none`` (Dr. GRPO).
        advantage_eps: added to the std when scaling rewards.
        loss_aggregation: ``token_mean`` (DAPO), ``seq_mean_token_mean`` (GRPO),
            ``seq_mean_token_sum_norm`` (Dr. GRPO) or ``rollout_mean`` (every trajectory alike).
        clip_low: lower ratio clip ε_low.
        clip_high: upper ratio clip ε_high (clip-higher: DAPO uses 0.28).
        dual_clip: dual-clip constant c (> 1) for negative advantages; None disables it.
        kl_coef: weight β of the KL penalty; 0 runs no reference pass (and, unless a workflow
            needs a frozen model for its frozen agents, loads no reference copy).
        kl_estimator: ``k1``, ``k3`` or ``low_var_kl``.
        entropy_coef: weight of an entropy bonus (subtracted from the loss).
        ppo_epochs: optimisation passes over each rollout batch (one optimizer step each).
        micro_batch_tokens: padded tokens per forward/backward micro-batch.
        max_grad_norm: gradient clipping norm (0 disables).
        max_consecutive_skipped_steps: an optimizer step whose loss or gradient norm is NaN or
            infinite is skipped (gradients dropped, ``train/skipped_steps``); this many skipped in
            a row stop the run.
        disable_dropout: set every dropout of the policy (LoRA's ``dropout`` included) to 0 when
            the model is configured, as TRL does: with dropout the policy's log-probs are noisy,
            so ratios to the old policy differ from 1 before any update and clip spuriously. The
            old and reference log-probs are computed in eval mode (no dropout) either way.
    """

    group_size: int = 4
    scale_rewards: grpo.ScaleRewards = "group"
    advantage_eps: float = 1e-4
    loss_aggregation: grpo.LossAggregation = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: grpo.KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    micro_batch_tokens: int = 8192
    max_grad_norm: float = 1.0
    max_consecutive_skipped_steps: int = 5
    disable_dropout: bool = True

    def __post_init__(self) -> None:
        p = "model.init_args.grpo."
        check_option(p + "group_size", self.group_size, 2, why="GRPO's advantage is relative to the group")
        check_option(p + "advantage_eps", self.advantage_eps, 0.0)
        check_option(p + "clip_low", self.clip_low, 0.0, 1.0, high_open=True, why="the ratio clips at 1 - clip_low")
        check_option(p + "clip_high", self.clip_high, 0.0)
        if self.dual_clip is not None:
            check_option(p + "dual_clip", self.dual_clip, 1.0, low_open=True, why="null disables it; verl uses 3.0")
        check_option(p + "kl_coef", self.kl_coef, 0.0, why="0 disables the KL penalty")
        check_option(p + "entropy_coef", self.entropy_coef)
        check_option(p + "ppo_epochs", self.ppo_epochs, 1)
        check_option(p + "micro_batch_tokens", self.micro_batch_tokens, 1)
        check_option(p + "max_grad_norm", self.max_grad_norm, 0.0, why="0 disables clipping")
        check_option(p + "max_consecutive_skipped_steps", self.max_consecutive_skipped_steps, 1)


@dataclass
class OptimizerSettings:
    """AdamW with linear warm-up then constant or cosine decay.

    Args:
        lr: peak learning rate (LoRA wants ~10x a full fine-tune's).
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: optimizer steps of linear warm-up.
        schedule: ``constant`` or ``cosine`` (decays to 10% over the trainer's ``max_steps``).
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: str = "constant"

    def __post_init__(self) -> None:
        p = "model.init_args.optimizer."
        check_option(p + "lr", self.lr, 0.0, low_open=True)
        check_option(p + "weight_decay", self.weight_decay, 0.0)
        for i, beta in enumerate(self.betas):
            check_option(f"{p}betas[{i}]", beta, 0.0, 1.0, high_open=True)
        check_option(p + "warmup_steps", self.warmup_steps, 0)
        if self.schedule not in ("constant", "cosine"):
            raise ConfigError(f"{p}schedule must be 'constant' or 'cosine' (got {self.schedule!r})")


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Split row indices into micro-batches whose padded size stays within ``token_budget``.

    Rows are sorted by length so rows of similar length share a micro-batch (less padding). A row
    longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
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


def evaluation_report(records: list[tuple], **info: Any) -> dict[str, Any]:
    """Exact match, F1 and extra metrics overall, by number of chunks and (when tasks have one) by category.

    A record is ``(chunks, em, f1)`` or ``(chunks, em, f1, extras)``; ``extras`` maps metric names to
    numbers (None: not measured for that task, left out of its mean) and may hold ``category``.
    """

    def extras(r: tuple) -> dict[str, Any]:
        return r[3] if len(r) > 3 else {}

    names = list(dict.fromkeys(k for r in records for k in extras(r) if k != "category"))

    def summary(rows: list[tuple]) -> dict[str, float]:
        out = {
            "tasks": len(rows),
            "exact_match": sum(r[1] for r in rows) / len(rows),
            "f1": sum(r[2] for r in rows) / len(rows),
        }
        for name in names:
            values = [extras(r)[name] for r in rows if extras(r).get(name) is not None]
            if values:
                out[name] = sum(values) / len(values)
        return out

    by_chunks = {str(n): summary([r for r in records if r[0] == n]) for n in sorted({r[0] for r in records})}
    report = {**info, "overall": summary(records), "by_num_chunks": by_chunks}
    categories = sorted({extras(r).get("category") for r in records} - {None}, key=str)
    if categories:
        report["by_category"] = {
            str(c): summary([r for r in records if extras(r).get("category") == c]) for c in categories
        }
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    extra = [k for k in report["overall"] if k not in ("tasks", "exact_match", "f1")]

    def table(title: str, rows: dict[str, dict[str, float]]) -> list[str]:
        out = [
            f"{title:>8} {'tasks':>6} {'exact_match':>12} {'f1':>7}" + "".join(f" {k:>{max(len(k), 7)}}" for k in extra)
        ]
        for key, row in [*rows.items(), ("all", report["overall"])]:
            line = f"{key:>8} {row['tasks']:>6} {100 * row['exact_match']:>11.1f}% {100 * row['f1']:>6.1f}%"
            for k in extra:
                width = max(len(k), 7) - 1
                line += f" {100 * row[k]:>{width}.1f}%" if k in row else " " * (width + 2)
            out.append(line)
        return out

    lines = [f"Evaluation at step {report.get('step', '?')} ({report.get('model', '')})"]
    lines += table("chunks", report["by_num_chunks"])
    if "by_category" in report:
        lines += table("category", report["by_category"])
    return "\n".join(lines)


class MemRLModule(L.LightningModule):
    """GRPO training of a memory agent.

    Args:
        model_name_or_path: policy as a hub id or local path, or ``tiny`` (random, offline).
        dtype: weight dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``. ``auto`` is bf16
            for a frozen LoRA base on hardware with fast bf16 (AMX, AVX512-BF16, CUDA) and fp32
            otherwise. For bf16 compute with fp32 master weights in a full fine-tune keep
            ``float32`` and set ``trainer.precision: bf16-mixed``.
        attn_implementation: ``auto`` (flash_attention_2 on CUDA when installed, else sdpa),
            ``sdpa``, ``eager``, ...
        lora: LoRA adapter settings; None trains every weight.
        quantization: 4-bit (NF4) base weights through bitsandbytes, trained with ``lora`` (QLoRA).
        gradient_checkpointing: recompute activations in the backward pass.
        workflow: how tasks become trajectories (default: MemAgent).
        rewards: reward functions, summed with their weights (default: exact match).
        generation: sampling settings of training rollouts.
        val_max_new_tokens: answer cap of greedy validation rollouts (default: generation's).
        answer_pattern: regular expression that picks the answer out of a final response for
            validation's exact match and F1 (e.g. ``\\b\\d{4}\\b``); None scores the whole
            ``\\boxed{}`` content or text. Reward functions take their own ``answer_pattern``.
        share_prefixes: compute a prompt prefix that group members share (MemAgent: the problem
            and the chunk) once per group, in rollouts (KV-cache prefill) and in the update.
        grpo: GRPO options.
        optimizer: optimizer and schedule.
        seed: seed of the ``tiny`` model's weights.
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        dtype: str = "float32",
        attn_implementation: str = "auto",
        lora: LoraSettings | None = None,
        quantization: QuantizationSettings | None = None,
        gradient_checkpointing: bool = False,
        workflow: Workflow | None = None,
        rewards: list[RewardFunction] | None = None,
        generation: GenerationSettings | None = None,
        val_max_new_tokens: int | None = None,
        answer_pattern: str | None = None,
        share_prefixes: bool = True,
        grpo: GRPOSettings | None = None,
        optimizer: OptimizerSettings | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.model_name_or_path, self.dtype_name = model_name_or_path, dtype
        self.attn_implementation, self.lora = attn_implementation, lora
        self.gradient_checkpointing, self.seed = gradient_checkpointing, seed
        self.quantization = quantization
        self.workflow = workflow or MemAgentWorkflow()
        self.reward_functions = rewards or [ExactMatch()]
        self.generation = generation or GenerationSettings()
        self.val_max_new_tokens = val_max_new_tokens
        check_answer_pattern(answer_pattern, "model.init_args.answer_pattern")
        self.answer_pattern = answer_pattern
        self.share_prefixes = share_prefixes
        self.grpo = grpo or GRPOSettings()
        self.optim = optimizer or OptimizerSettings()
        self._skips = guards.SkipCounter(self.grpo.max_consecutive_skipped_steps)
        names = [r.name for r in self.reward_functions]
        if len(set(names)) != len(names):
            raise ValueError(f"model.rewards: reward names must be unique, got {names}; set name: on each")
        if self.grpo.group_size < 1 or self.grpo.ppo_epochs < 1:
            raise ValueError("model.grpo: group_size and ppo_epochs must be >= 1")
        self.policy: Any = None
        self.tokenizer: Any = None
        self.engine: RolloutEngine | None = None
        self._reference: Any = None  # not a registered submodule: kept out of checkpoints
        self.val_exact_match, self.val_f1, self.val_reward = MeanMetric(), MeanMetric(), MeanMetric()
        self._val_records: list[tuple[int, float, float]] = []  # (chunks read, EM, F1) per task
        self._checkpoint_step = 0  # step of the checkpoint a validate/test run loaded
        # trainable parts of the workflow (e.g. RMM's reranker): registered, so they reach the
        # optimizer and the checkpoint; the workflow object itself stays a plain object
        self.workflow_modules = torch.nn.ModuleDict(self.workflow.torch_modules())

    # ------------------------------------------------------------------ models
    def configure_model(self) -> None:
        """Load tokenizer, policy and (without LoRA, when ``kl_coef > 0`` or the workflow
        ``needs_frozen_model``) the reference: a frozen copy of the initial weights.

        A workflow that needs a frozen model gets :meth:`frozen_engine` as its ``frozen_engine``.

        Idempotent: Lightning calls it for every fit/validate/test/predict. Under
        ``ModelParallelStrategy`` both models are loaded on rank 0, and every decoder layer and
        then the root are sharded with ``fully_shard`` (see ``lightning_memrl.distributed``).
        """
        if self.policy is not None:
            return
        mesh = self._device_mesh["data_parallel"] if self._device_mesh is not None else None
        if mesh is not None and self.quantization is not None:
            raise ValueError("model.init_args.quantization cannot be combined with ModelParallelStrategy sharding")
        if mesh is not None:
            distributed.allow_classes_of(dict(self.hparams))  # sharded checkpoints load with weights_only=True

        def load(reference: bool = False) -> Any:
            def build(empty_weights: bool = False) -> Any:
                if reference:
                    return load_policy(
                        self.model_name_or_path,
                        self.tokenizer,
                        self.dtype_name,
                        self.attn_implementation,
                        seed=self.seed,
                        empty_weights=empty_weights,
                    )
                return load_policy(
                    self.model_name_or_path,
                    self.tokenizer,
                    self.dtype_name,
                    self.attn_implementation,
                    self.lora,
                    self.gradient_checkpointing,
                    self.seed,
                    self.quantization,
                    empty_weights=empty_weights,
                )

            if mesh is None:
                return build()
            strategy = self.trainer.strategy if self._trainer is not None else None
            shard_kwargs = strategy.fsdp_kwargs() if isinstance(strategy, distributed.FSDP2Strategy) else {}
            return distributed.load_sharded(build, mesh, **shard_kwargs)

        self.tokenizer = load_tokenizer(self.model_name_or_path)
        self.policy = load()
        needs_frozen = self.workflow.needs_frozen_model()
        if (self.grpo.kl_coef > 0 or needs_frozen) and self.lora is None:
            reference = load(reference=True)
            reference.eval().requires_grad_(False)
            self.__dict__["_reference"] = reference  # bypass nn.Module registration: no checkpoint copy
        if self.grpo.disable_dropout:
            for layer in self.policy.modules():
                if isinstance(layer, torch.nn.modules.dropout._DropoutNd):
                    layer.p = 0.0
        self.policy.train()  # from_pretrained returns eval mode; validation switches it per call
        self.engine = RolloutEngine(self.policy, self.tokenizer, share_prefixes=self.share_prefixes)
        if needs_frozen:
            frozen = self.workflow.frozen_engine = self.frozen_engine()
            log.info("%s: frozen agents generate with %s", type(self.workflow).__name__, frozen.description)

    def frozen_engine(self) -> FrozenRolloutEngine:
        """A rollout engine over the model a workflow's frozen agents use: the LoRA base with the
        adapters disabled, else the reference (a frozen copy of the initial weights)."""
        if self.lora is not None:
            return FrozenRolloutEngine(
                self.policy,
                self.tokenizer,
                f"the base model {self.model_name_or_path} with LoRA adapters disabled",
                context=self.policy.disable_adapter,
                share_prefixes=self.share_prefixes,
            )
        return FrozenRolloutEngine(
            self._reference,
            self.tokenizer,
            f"a frozen copy of the initial weights of {self.model_name_or_path}",
            share_prefixes=self.share_prefixes,
        )

    def reference_context(self) -> Any:
        """Context in which ``self.policy`` computes reference log-probs (LoRA: adapters off)."""
        return self.policy.disable_adapter() if self.lora is not None else nullcontext()

    # ------------------------------------------------------------------ (b) (c) (e) overridable steps
    def rollout(self, tasks: list[Task], settings: GenerationSettings) -> RolloutBatch:
        """Run the workflow on ``tasks`` (group members already repeated) and flatten the turns."""
        was_training = self.policy.training
        self.policy.eval()
        use_cache = self.policy.config.use_cache
        self.policy.config.use_cache = True
        try:
            with ExitStack() as stack:
                stack.enter_context(distributed.unsharded_for_rollout(self.policy))  # sharded: gathered once
                if self.workflow.frozen_engine is not None and self._reference is not None:
                    self._reference.to(self.device)  # the frozen agents' model
                    stack.enter_context(distributed.unsharded_for_rollout(self._reference))
                trajectories = self.workflow.rollout(self.engine, tasks, settings)
        finally:
            self.policy.config.use_cache = use_cache
            self.policy.train(was_training)
        return RolloutBatch.from_trajectories(trajectories, self.grpo.group_size, self.engine.pad_id)

    def score(self, rollouts: RolloutBatch) -> None:
        """Fill ``rollouts.rewards`` [N] (weighted sum) and ``reward_components`` (name → [N]).

        A trajectory that every reward function leaves unscored (None) gets NaN; so does one for
        which a function returns NaN or ±inf (counted in ``self.nonfinite_rewards``). A value that
        is not a number stops the run with an error naming the function.
        """
        components = {r.name: torch.full((rollouts.num_trajectories,), math.nan) for r in self.reward_functions}
        total = torch.full((rollouts.num_trajectories,), math.nan)
        nonfinite = torch.zeros(rollouts.num_trajectories, dtype=torch.bool)
        for i, trajectory in enumerate(rollouts.trajectories):
            for fn in self.reward_functions:
                owner = f"reward function {fn.name!r} ({type(fn).__name__})"
                value = guards.reward_value(fn(trajectory.final_text, trajectory.task.answers), owner)
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
        self.nonfinite_rewards = int(nonfinite.sum())
        rollouts.rewards, rollouts.reward_components = total, components

    def compute_advantages(self, rollouts: RolloutBatch) -> Tensor:
        """One advantage per trajectory ([N]) from ``rollouts.rewards`` by group statistics."""
        return grpo.group_advantages(
            rollouts.rewards, rollouts.group_size, self.grpo.scale_rewards, self.grpo.advantage_eps
        )

    # ------------------------------------------------------------------ log-probs and loss
    def sequence_logprobs(
        self,
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
        device = self.device
        width = max(len(p) for p in prompts)
        batch, resp_len = response_ids.shape
        input_ids = torch.full((batch, width + resp_len), self.engine.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) : width] = 1
        input_ids[:, width:] = response_ids
        attention[:, width:] = response_mask
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        inputs = {
            "input_ids": input_ids.to(device),
            "attention_mask": attention.to(device),
            "position_ids": position_ids.to(device),
            "use_cache": False,
        }
        temperature = self.generation.temperature if self.generation.temperature > 0 else 1.0
        targets = response_ids.to(device)
        parts = split_head(model)
        groups = self._update_prefix_groups(prompts) if parts is not None else []
        if parts is not None:
            decoder, head = parts
            if groups:  # one prefix pass per group, its KV cache (and gradient) shared by the members
                hidden = self._shared_prefix_hidden(decoder, prompts, response_ids, response_mask, groups)
            else:
                hidden = decoder(**inputs).last_hidden_state[:, width - 1 : -1]  # [B, R, H]: t predicts token t
            logprobs, entropy = head_logprobs(
                hidden, head, targets, temperature, with_entropy, entropy_grad=self.grpo.entropy_coef != 0
            )
        else:
            logits = model(**inputs, logits_to_keep=resp_len + 1).logits[:, :-1]  # [B, R, V]
            logprobs = selected_logprobs(logits, targets, temperature)
            entropy = grpo.entropy_from_logits(logits.float() / temperature) if with_entropy else None
        if entropy is not None and self.grpo.entropy_coef == 0:
            entropy = entropy.detach()  # a metric only
        return logprobs, entropy

    def _update_prefix_groups(self, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
        """Groups of rows whose prompts share a prefix, or ``[]`` when sharing is off or saves nothing.

        Off with gradient checkpointing, whose recomputation would write the KV cache twice.
        """
        if not self.share_prefixes or self.gradient_checkpointing:
            return []
        order = sorted(range(len(prompts)), key=lambda i: prompts[i])  # equal prefixes side by side
        groups = shared_prefix_groups(
            [prompts[i] for i in order], getattr(self.engine, "min_shared_prefix", MIN_SHARED_PREFIX)
        )
        groups = [(length, [order[r] for r in rows]) for length, rows in groups]
        return groups if any(len(rows) > 1 for _, rows in groups) else []

    def _shared_prefix_hidden(
        self,
        decoder: Any,
        prompts: list[list[int]],
        response_ids: Tensor,  # [B, R]
        response_mask: Tensor,  # [B, R]
        groups: list[tuple[int, list[int]]],
    ) -> Tensor:  # [B, R, H] hidden states that predict the response tokens
        """Decoder states for ``[prefix][rest of prompt][response]`` with each prefix computed once.

        Exact: a causal model's states over a shared prefix do not depend on what follows, so the
        prefix's keys and values are computed once per group and copied (by a differentiable
        index) to its members; the members' gradients flow back into that one computation.
        """
        from transformers import DynamicCache

        device = self.device
        group_of_row = [0] * len(prompts)
        for g, (_, rows) in enumerate(groups):
            for row in rows:
                group_of_row[row] = g
        prefixes = [prompts[rows[0]][:length] for length, rows in groups]
        prefix_ids, prefix_mask = left_pad(prefixes, self.engine.pad_id, device)  # [G, P]
        rests = [prompt[groups[g][0] :] for prompt, g in zip(prompts, group_of_row)]
        rest_ids, rest_mask = left_pad(rests, self.engine.pad_id, device)  # [B, S]
        index = torch.tensor(group_of_row, device=device)
        full_mask = torch.cat([prefix_mask[index], rest_mask, response_mask.to(device)], dim=1)  # [B, P+S+R]
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        decoder(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
        )
        cache.reorder_cache(index)  # [G, ...] -> [B, ...]
        prefix_width, rest_width = prefix_ids.shape[1], rest_ids.shape[1]
        hidden = decoder(
            input_ids=torch.cat([rest_ids, response_ids.to(device)], dim=1),
            attention_mask=full_mask,
            position_ids=positions[:, prefix_width:],
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # [B, S+R, H]
        return hidden[:, rest_width - 1 : -1]

    def policy_loss(
        self,
        logprobs: Tensor,  # [B, R]
        old_logprobs: Tensor,  # [B, R]
        ref_logprobs: Tensor | None,  # [B, R]
        advantages: Tensor,  # [B, R]
        weights: Tensor,  # [B, R] aggregation weights over the whole batch
        entropy: Tensor | None,  # [B, R]
        mask: Tensor,  # [B, R]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped surrogate + β·KL − entropy bonus, aggregated by ``weights``.

        Returns the micro-batch's share of the batch loss and sums for metrics.
        """
        g = self.grpo
        token_loss, clipped, dual_clipped = grpo.clipped_surrogate(
            logprobs, old_logprobs, advantages, g.clip_low, g.clip_high, g.dual_clip
        )
        stats = {"clip_frac": (clipped & mask).sum(), "dual_clip_frac": (dual_clipped & mask).sum()}
        if ref_logprobs is not None and g.kl_coef > 0:
            kl = grpo.kl_penalty(logprobs, ref_logprobs, g.kl_estimator)
            token_loss = token_loss + g.kl_coef * kl
            stats["kl"] = (kl.detach() * mask).sum()
        if entropy is not None:
            if g.entropy_coef:
                token_loss = token_loss - g.entropy_coef * entropy
            stats["entropy"] = (entropy.detach() * mask).sum()
        loss = (token_loss * weights).sum()
        return loss, stats

    # ------------------------------------------------------------------ training
    def training_step(self, batch: list[Task], batch_idx: int) -> None:
        """One GRPO step (see the module docstring for the phases)."""
        step_start = time.perf_counter()
        tasks = [task for task in batch for _ in range(self.grpo.group_size)]  # (a)
        rollouts = self.rollout(tasks, self.generation)  # (b)
        rollout_time = time.perf_counter() - step_start
        self.nonfinite_rewards = 0
        self.score(rollouts)  # (c)
        scored = rollouts.rewards.clone()
        for callback in self._memrl_callbacks():  # (d)
            callback.on_rewards(self.trainer, self, rollouts)
        shaped = rollouts.rewards.clone()
        shaped.index_add_(0, rollouts.turn_to_trajectory, rollouts.turn_rewards)
        reward_stats = self._guard_rewards(rollouts, shaped, scored)
        rollouts.trajectory_advantages = self.compute_advantages(rollouts)  # (e) per trajectory
        per_turn = rollouts.trajectory_advantages[rollouts.turn_to_trajectory]  # [M] broadcast
        rollouts.advantages = per_turn.unsqueeze(-1) * rollouts.response_mask  # [M, T]
        for callback in self._memrl_callbacks():  # (f)
            callback.on_advantages(self.trainer, self, rollouts)
        auxiliary = self.workflow.auxiliary_loss(rollouts)  # e.g. a reranker's REINFORCE loss
        if auxiliary is not None:  # its gradients join the policy's first optimizer step
            if auxiliary[0] is not None:
                self.manual_backward(auxiliary[0])
            self.log_dict({f"train/{k}": v for k, v in auxiliary[1].items()}, batch_size=rollouts.num_trajectories)
        update_start = time.perf_counter()
        update_stats = self.update(rollouts)  # (g)
        update_time = time.perf_counter() - update_start
        update_stats.update(reward_stats)
        self._log_step(rollouts, update_stats, rollout_time, update_time, time.perf_counter() - step_start)  # (h)

    def _guard_rewards(self, rollouts: RolloutBatch, shaped: Tensor, scored: Tensor) -> dict[str, float]:
        """Set ``rollouts.rewards`` to ``shaped`` with ±inf as NaN; count non-finite and NaN rewards.

        A NaN reward is left out of its group's baseline and gets advantage 0. Warns when every
        reward of the step is NaN: such a step trains nothing but the KL and entropy terms.
        """
        nonfinite = self.nonfinite_rewards + guards.nonfinite_count(shaped, unscored=scored)  # + shaping's
        rollouts.rewards = guards.finite_or_nan(shaped)
        frac_nan = float(torch.isnan(rollouts.rewards).float().mean()) if rollouts.num_trajectories else 0.0
        if frac_nan == 1.0:
            log.warning(
                "step %d: every reward is NaN (%d trajectories, %d of them non-finite values, the rest unscored): "
                "the advantages are all 0 and the policy learns nothing from this step; check the reward functions",
                self.global_step,
                rollouts.num_trajectories,
                nonfinite,
            )
        return {"nonfinite_rewards": float(nonfinite), "frac_reward_nan": frac_nan}

    def update(self, rollouts: RolloutBatch) -> dict[str, float]:
        """``ppo_epochs`` optimizer steps over token-budgeted micro-batches of the rollouts."""
        g = self.grpo
        opt = self.optimizers()
        scheduler = self.lr_schedulers()
        mask = rollouts.response_mask.bool()
        weights = grpo.loss_token_weights(
            rollouts.response_mask,
            rollouts.turn_to_trajectory,
            g.loss_aggregation,
            self.workflow.max_response_tokens(self.generation),
        )
        lengths = [len(p) + int(n) for p, n in zip(rollouts.prompt_ids, rollouts.response_mask.sum(-1))]
        batches = micro_batches(lengths, g.micro_batch_tokens)
        if distributed.max_over_ranks(len(batches)) == 0:  # no trainable turn on any rank (only frozen agents spoke)
            opt.step()  # still one step: global_step advances, a workflow module's gradients apply
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            return {"loss": 0.0, "grad_norm": 0.0, "reference_time": 0.0, "logprob_gap": 0.0, "micro_batches": 0.0}
        placeholder = not batches  # only this rank has no trainable turn: zero-weight passes keep it in step
        if placeholder:
            rollouts, weights, batches = rollouts.with_placeholder_row(self.engine.pad_id), torch.zeros(1, 1), [[0]]
        batches, real_batches = distributed.equalize_micro_batches(batches)  # same pass count on every rank
        real_batches = 0 if placeholder else real_batches

        def rows(idx: list[int]) -> tuple[list[list[int]], Tensor, Tensor]:
            width = int(rollouts.response_mask[idx].sum(-1).max())  # trim shared padding
            return (
                [rollouts.prompt_ids[i] for i in idx],
                rollouts.response_ids[idx, :width],
                rollouts.response_mask[idx, :width],
            )

        need_old = g.ppo_epochs > 1
        need_ref = g.kl_coef > 0
        old_lp: dict[int, Tensor] = {}
        ref_lp: dict[int, Tensor] = {}
        ref_time = 0.0
        if need_old or need_ref:
            start = time.perf_counter()
            was_training = self.policy.training
            self.policy.eval()  # old / reference log-probs without dropout noise
            with torch.no_grad():
                for b, idx in enumerate(batches):
                    prompts, ids, m = rows(idx)
                    if need_old:
                        old_lp[b] = self.sequence_logprobs(self.policy, prompts, ids, m)[0]
                    if need_ref:
                        if self._reference is not None:
                            self._reference.to(self.device)
                            ref_lp[b] = self.sequence_logprobs(self._reference, prompts, ids, m)[0]
                        else:
                            with self.reference_context():
                                ref_lp[b] = self.sequence_logprobs(self.policy, prompts, ids, m)[0]
            self.policy.train(was_training)
            ref_time = time.perf_counter() - start
        sums: dict[str, float] = {}
        loss_total, grad_norm = 0.0, 0.0
        logprob_gap, skipped = 0.0, 0
        for epoch in range(g.ppo_epochs):
            epoch_loss = 0.0
            for b, idx in enumerate(batches):
                prompts, ids, m = rows(idx)
                width = ids.shape[1]
                logprobs, entropy = self.sequence_logprobs(self.policy, prompts, ids, m, with_entropy=True)
                m_dev = m.to(self.device).bool()
                old = old_lp[b] if need_old else logprobs.detach()
                if epoch == 0 and b < real_batches:  # how far the trainer's log-probs are from the sampler's
                    rollout_lp = rollouts.rollout_logprobs[idx, :width].to(self.device)
                    logprob_gap += float(((logprobs.detach() - rollout_lp).abs() * m_dev).sum())
                loss, stats = self.policy_loss(
                    logprobs,
                    old,
                    ref_lp.get(b),
                    rollouts.advantages[idx, :width].to(self.device),
                    weights[idx, :width].to(self.device),
                    entropy,
                    m_dev,
                )
                if b >= real_batches:  # a repeat that only keeps ranks in step: no contribution
                    loss, stats = loss * 0.0, {}
                self.manual_backward(loss)
                epoch_loss += float(loss.detach())
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
            loss_total += epoch_loss
            grad_norm, skip = self._clip_gradients_or_skip(opt, epoch_loss)
            skipped += skip
            opt.step()  # after a skip no parameter has a gradient: AdamW changes no weight and no moment
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        tokens = float(mask.sum()) * g.ppo_epochs
        out = {key: value / tokens for key, value in sums.items()}
        out.update(
            loss=loss_total / g.ppo_epochs,
            grad_norm=grad_norm,
            reference_time=ref_time,
            logprob_gap=logprob_gap / max(float(mask.sum()), 1.0),
            micro_batches=float(len(batches)),
            skipped_steps=float(skipped),
        )
        return out

    def _clip_gradients_or_skip(self, opt: Any, loss: float) -> tuple[float, bool]:
        """Clip the policy's gradients to ``max_grad_norm``; drop them all when the step must be skipped.

        A step is skipped when its loss, its gradient norm or a workflow module's gradient is NaN
        or infinite on any rank. Every gradient is then set to None, so the ``opt.step()`` that
        follows changes no weight and no AdamW moment, while ``global_step`` and the LR scheduler
        still advance (as with a mixed-precision GradScaler's skipped step): ``max_steps`` counts
        attempted steps. ``max_consecutive_skipped_steps`` skipped in a row stop the run.

        Returns:
            The gradient norm before clipping (also when clipping is off) and whether the step is skipped.
        """
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = self.grpo.max_grad_norm if self.grpo.max_grad_norm > 0 else math.inf  # inf: measure only
        grad_norm = distributed.clip_grad_norm(params, max_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        finite = finite and guards.grads_are_finite(self.workflow_modules.parameters())
        skip = bool(distributed.max_over_ranks(int(not finite)))  # every rank skips together
        if skip:
            opt.zero_grad(set_to_none=True)
            log.warning("step %d: loss %.4g, gradient norm %.4g: step skipped", self.global_step, loss, grad_norm)
        self._skips.record(skip, f"loss={loss:.4g}, grad_norm={grad_norm:.4g} at step {self.global_step}")
        return grad_norm, skip

    def _memrl_callbacks(self) -> list[Any]:
        from lightning_memrl.callbacks import MemRLCallback

        return [c for c in self.trainer.callbacks if isinstance(c, MemRLCallback)]

    def _log_step(
        self, rollouts: RolloutBatch, stats: dict[str, float], rollout_time: float, update_time: float, step_time: float
    ) -> None:
        rewards = rollouts.rewards
        valid = rewards[~torch.isnan(rewards)]
        grouped = rewards.view(-1, rollouts.group_size)
        zero_std = torch.tensor(
            [
                float(torch.nan_to_num(g[~torch.isnan(g)].std(), 0.0) == 0) if (~torch.isnan(g)).sum() > 1 else 1.0
                for g in grouped
            ]
        )
        lengths = rollouts.response_mask.sum(-1).float()
        is_mem = rollouts.memory_tokens_mask
        tokens = float(lengths.sum())
        metrics = {
            "train/reward": float(valid.mean()) if valid.numel() else math.nan,
            "train/reward_std": float(valid.std()) if valid.numel() > 1 else 0.0,
            "train/frac_reward_zero_std": float(zero_std.mean()),
            "train/nonfinite_rewards": stats.get("nonfinite_rewards", 0.0),
            "train/frac_reward_nan": stats.get("frac_reward_nan", 0.0),
            "train/skipped_steps": stats.get("skipped_steps", 0.0),
            "train/advantage_abs": float(rollouts.trajectory_advantages.abs().mean()),
            "train/response_length": float(lengths[~is_mem].mean()) if (~is_mem).any() else 0.0,
            "train/memory_length": float(lengths[is_mem].mean()) if is_mem.any() else 0.0,
            "train/truncation_ratio": float(rollouts.truncated.float().mean()) if rollouts.truncated.numel() else 0.0,
            "train/turns_per_trajectory": rollouts.response_ids.shape[0] / rollouts.num_trajectories,
            "train/loss": stats["loss"],
            "train/grad_norm": stats["grad_norm"],
            "train/clip_frac": stats.get("clip_frac", 0.0),
            "train/dual_clip_frac": stats.get("dual_clip_frac", 0.0),
            "train/entropy": stats.get("entropy", 0.0),
            "train/logprob_gap": stats["logprob_gap"],
            "train/lr": float(self.optimizers().param_groups[0]["lr"]),
            "time/rollout_s": rollout_time,
            "time/reference_s": stats["reference_time"],
            "time/update_s": update_time,
            "time/step_s": step_time,
            "time/rollout_tokens_per_s": tokens / max(rollout_time, 1e-9),
            "time/update_tokens_per_s": tokens * self.grpo.ppo_epochs / max(update_time, 1e-9),
        }
        if self.grpo.kl_coef > 0:  # every rank logs the same keys (sync_dist), one without turns too
            metrics["train/kl"] = stats.get("kl", 0.0)
        for name, values in rollouts.reward_components.items():
            scored = values[~torch.isnan(values)]
            metrics[f"train/reward/{name}"] = float(scored.mean()) if scored.numel() else math.nan
        self.log_dict(metrics, batch_size=rollouts.num_trajectories, sync_dist=distributed.is_distributed())
        self.log("reward", metrics["train/reward"], prog_bar=True, logger=False, batch_size=rollouts.num_trajectories)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: list[Task], batch_idx: int) -> None:
        """Greedy rollouts scored by exact match, token F1 and the training reward."""
        settings = GenerationSettings(
            temperature=0.0,
            max_new_tokens=self.val_max_new_tokens or self.generation.max_new_tokens,
            stop_strings=self.generation.stop_strings,
            max_prompt_length=self.generation.max_prompt_length,
        )
        with torch.no_grad():
            rollouts = self.rollout(list(batch), settings)
        self.score(rollouts)
        for trajectory in rollouts.trajectories:
            answer = answer_from_completion(trajectory.final_text, self.answer_pattern)
            em, f1 = exact_match(answer, trajectory.task.answers), token_f1(answer, trajectory.task.answers)
            self.val_exact_match.update(em)
            self.val_f1.update(f1)
            extras = {"category": trajectory.task.meta.get("category"), "bleu1": bleu1(answer, trajectory.task.answers)}
            extras.update(self.workflow.evaluation_metrics(trajectory))
            self._val_records.append((len(trajectory.chunks), em, f1, extras))
            self._val_predictions.append(
                {
                    "id": trajectory.task.id,
                    "question": trajectory.task.question,
                    "answers": trajectory.task.answers,
                    "chunks": len(trajectory.chunks),
                    "memories": trajectory.memories,
                    "completion": trajectory.final_text,
                    "answer": answer,
                    "exact_match": em,
                }
            )
        valid = rollouts.rewards[~torch.isnan(rollouts.rewards)]
        if valid.numel():
            self.val_reward.update(valid)
        n = len(batch)
        self.log("val/exact_match", self.val_exact_match, prog_bar=True, batch_size=n)
        self.log("val/f1", self.val_f1, batch_size=n)
        self.log("val/reward", self.val_reward, batch_size=n)

    test_step = validation_step

    def on_validation_epoch_start(self) -> None:
        self._val_records = []
        self._val_predictions: list[dict[str, Any]] = []

    def on_validation_epoch_end(self) -> None:
        """Print exact match and F1 overall and by number of chunks; save them as JSON.

        Next to ``eval_report_step<N>.json``, ``eval_predictions_step<N>.jsonl`` holds one line per
        task: question, gold answers, the memory after each turn, the completion and its score.
        """
        if self.trainer.sanity_checking:
            return
        records = distributed.gather_objects(self._val_records)  # every rank's tasks
        predictions = distributed.gather_objects(self._val_predictions)
        if not records:
            return
        step = self.global_step if self.trainer.state.fn == "fit" else self._checkpoint_step
        report = evaluation_report(records, step=step, model=self.model_name_or_path)
        log_dir = self.trainer.log_dir or self.trainer.default_root_dir
        if self.trainer.is_global_zero:
            print(format_report(report))
            path = Path(log_dir) / f"eval_report_step{step}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
            lines = "".join(json.dumps(row) + "\n" for row in predictions)
            (path.parent / f"eval_predictions_step{step}.jsonl").write_text(lines)

    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    # ------------------------------------------------------------------ optimisation and state
    def configure_optimizers(self) -> Any:
        o = self.optim
        params = [p for p in self.policy.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": params}]
        extra = [p for p in self.workflow_modules.parameters() if p.requires_grad]
        if extra:  # the workflow's own modules, at their own learning rate
            groups.append({"params": extra, "lr": self.workflow.module_lr or o.lr})
        every = [p for group in groups for p in group["params"]]
        # The fused kernel is one pass over each tensor; the default on CPU is a Python loop over
        # parameters that cost 0.9 s of a 9.8 s full fine-tuning step of SmolLM2 on 2 cores.
        fused = bool(every) and all(
            type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in every
        )  # sharded (DTensor) parameters keep the default implementation
        optimizer = torch.optim.AdamW(
            groups, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=fused or None
        )
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        if o.schedule not in ("constant", "cosine"):
            raise ValueError(f"model.optimizer.schedule must be 'constant' or 'cosine', got {o.schedule!r}")

        def factor(step: int) -> float:
            if o.warmup_steps and step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            if o.schedule == "cosine" and total:
                progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
                return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
            return 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_callbacks(self) -> list[L.Callback]:
        """RNG states in checkpoints, and a checkpoint and exit code 143 on SIGTERM (see ``lightning_memrl.resume``)."""
        from lightning_memrl.resume import ExactResume

        return [ExactResume()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guards.check_finite_checkpoint(checkpoint)  # a NaN checkpoint would replace the last good one
        checkpoint["memrl_workflow"] = self.workflow.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.workflow.load_state_dict(checkpoint.get("memrl_workflow", {}))
        self._checkpoint_step = int(checkpoint.get("global_step", 0))  # validate does not restore it
