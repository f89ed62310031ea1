"""``MemRLModule``: the policy, its frozen reference and the memory workflow, trained by GRPO.

One training step (``training_step``):

(a) repeat each task ``group_size`` times → (b) :meth:`rollout` (the workflow's batched turns)
→ (c) :meth:`score` (weighted reward functions) → (d) callbacks' ``on_rewards`` → (e)
:meth:`compute_advantages` per trajectory, broadcast to every token of its turns → (f) callbacks'
``on_advantages`` → (g) :meth:`update`: ``ppo_epochs`` passes over token-budgeted micro-batches
of :meth:`policy_loss`, gradient clipping, optimizer and LR-scheduler steps → (h) metrics.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, nullcontext
from functools import partial
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from lightning_memrl import distributed, grpo, guards, learner
from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.evaluation.metrics import bleu1
from lightning_memrl.evaluation.report import (
    evaluation_report,
    format_report,
    prediction_row,
    step_metrics,
    write_evaluation,
)
from lightning_memrl.learner import micro_batches
from lightning_memrl.models import LoraSettings, QuantizationSettings, load_policy, load_tokenizer
from lightning_memrl.resume import ExactResume
from lightning_memrl.rewards import (
    ExactMatch,
    RewardFunction,
    answer_from_completion,
    check_answer_pattern,
    exact_match,
    token_f1,
)
from lightning_memrl.rollout.base import RolloutBackend, RolloutBackendFactory, check_backend
from lightning_memrl.rollout.frozen import FrozenRolloutEngine
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings, GRPOSettings, OptimizerSettings, build_optimizer
from lightning_memrl.types import RolloutBatch, Task
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow

__all__ = ["GRPOSettings", "MemRLModule", "OptimizerSettings", "evaluation_report", "format_report", "micro_batches"]

log = logging.getLogger(__name__)


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
            and the chunk) once per group, in the update and in the default engine's rollouts
            (KV-cache prefill); a backend chosen by ``rollout`` takes its own option.
        grpo: GRPO options.
        optimizer: optimizer and schedule.
        seed: seed of the ``tiny`` model's weights.
        rollout: the rollout backend, built as ``rollout(policy, tokenizer)`` (see
            :mod:`lightning_memrl.rollout.base`); in YAML ``{class_path: ..., init_args: {...}}``.
            None: :class:`~lightning_memrl.rollout.hf.RolloutEngine`, sampling from the live policy.
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
        rollout: RolloutBackendFactory | None = None,
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
        self.rollout_factory = rollout or partial(RolloutEngine, share_prefixes=share_prefixes)
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
        self.engine: RolloutBackend | None = None
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

        self.tokenizer = load_tokenizer(self.model_name_or_path)
        self.policy = self._load_model(mesh)
        needs_frozen = self.workflow.needs_frozen_model()
        if (self.grpo.kl_coef > 0 or needs_frozen) and self.lora is None:
            reference = self._load_model(mesh, reference=True)
            reference.eval().requires_grad_(False)
            self.__dict__["_reference"] = reference  # bypass nn.Module registration: no checkpoint copy
        if self.grpo.disable_dropout:
            for layer in self.policy.modules():
                if isinstance(layer, torch.nn.modules.dropout._DropoutNd):
                    layer.p = 0.0
        self.policy.train()  # from_pretrained returns eval mode; validation switches it per call
        self.engine = check_backend(self.rollout_factory(self.policy, self.tokenizer), "model.init_args.rollout")
        if needs_frozen:
            frozen = self.workflow.frozen_engine = self.frozen_engine()
            log.info("%s: frozen agents generate with %s", type(self.workflow).__name__, frozen.description)

    def _load_model(self, mesh: Any, reference: bool = False) -> Any:
        """The policy (or, with ``reference``, a plain copy of the base weights), sharded over ``mesh`` when given."""

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

    def on_train_start(self) -> None:
        """Hand the rollout backend the policy's weights as training (or validation, testing) starts:
        they may have been loaded from a checkpoint or moved to their device after it was built."""
        self.engine.sync_weights(self.policy)

    on_validation_start = on_test_start = on_train_start

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
        total, components, self.nonfinite_rewards = learner.score_trajectories(self.reward_functions, rollouts)
        rollouts.rewards, rollouts.reward_components = total, components

    def compute_advantages(self, rollouts: RolloutBatch) -> Tensor:
        """One advantage per trajectory ([N]) from ``rollouts.rewards`` by group statistics."""
        return grpo.group_advantages(
            rollouts.rewards, rollouts.group_size, self.grpo.scale_rewards, self.grpo.advantage_eps
        )

    # ------------------------------------------------------------------ log-probs and loss (lightning_memrl.learner)
    def sequence_logprobs(
        self,
        model: Any,
        prompts: list[list[int]],
        response_ids: Tensor,
        response_mask: Tensor,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs of ``response_ids`` [B, R] after their prompts (:func:`.learner.sequence_logprobs`)."""
        return learner.sequence_logprobs(self, model, prompts, response_ids, response_mask, with_entropy)

    def _update_prefix_groups(self, prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
        return learner.update_prefix_groups(self, prompts)

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
        """Clipped surrogate + β·KL − entropy bonus: :func:`~lightning_memrl.learner.policy_loss`."""
        return learner.policy_loss(self.grpo, logprobs, old_logprobs, ref_logprobs, advantages, weights, entropy, mask)

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
        """``ppo_epochs`` optimizer steps over token-budgeted micro-batches: :func:`~lightning_memrl.learner.update`."""
        return learner.update(self, rollouts)

    def _clip_gradients_or_skip(self, opt: Any, loss: float) -> tuple[float, bool]:
        return learner.clip_gradients_or_skip(self, opt, loss)

    def _memrl_callbacks(self) -> list[Any]:
        return [c for c in self.trainer.callbacks if isinstance(c, MemRLCallback)]

    def _log_step(
        self, rollouts: RolloutBatch, stats: dict[str, float], rollout_time: float, update_time: float, step_time: float
    ) -> None:
        lr = float(self.optimizers().param_groups[0]["lr"])
        timing = (rollout_time, update_time, step_time)
        metrics = step_metrics(rollouts, stats, lr, timing, self.grpo.ppo_epochs, self.grpo.kl_coef > 0)
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
            self._val_predictions.append(prediction_row(trajectory, answer, em))
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
            write_evaluation(report, predictions, log_dir)

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
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        return build_optimizer(o, groups, total)

    def configure_callbacks(self) -> list[L.Callback]:
        """RNG states in checkpoints, and a checkpoint and exit code 143 on SIGTERM (see ``lightning_memrl.resume``)."""
        return [ExactResume()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guards.check_finite_checkpoint(checkpoint)  # a NaN checkpoint would replace the last good one
        checkpoint["memrl_workflow"] = self.workflow.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.workflow.load_state_dict(checkpoint.get("memrl_workflow", {}))
        self._checkpoint_step = int(checkpoint.get("global_step", 0))  # validate does not restore it
