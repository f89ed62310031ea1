"""``MemRLModule``: the policy, its frozen reference and the memory workflow, trained by GRPO.

One training step (``training_step``):

(a) repeat each task ``group_size`` times → (b) :meth:`rollout` (the workflow's batched turns)
→ (c) :meth:`score` (weighted reward functions) → (d) callbacks' ``on_rewards`` (with
``dynamic_sampling``: groups of equal rewards dropped, further tasks rolled out and scored) → (e)
the ``advantage`` estimator per trajectory (or per turn), broadcast to the tokens → (f) callbacks'
``on_advantages`` → (g) :meth:`update`: ``ppo_epochs`` passes over token-budgeted micro-batches
of the policy loss, gradient clipping, optimizer and LR-scheduler steps → (h) metrics.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from functools import partial
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_memrl import adapter_files, allocator, console, distributed, guards, learner
from lightning_memrl.adapters import check_base_reference
from lightning_memrl.advantages import AdvantageEstimator, GroupRelative, assign_advantages
from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.dynamic_sampling import DynamicSampling
from lightning_memrl.evaluation.report import EvaluationLog, step_metrics
from lightning_memrl.evaluation.tables import log_step_completions
from lightning_memrl.models import LoraSettings, QuantizationSettings, load_policy, load_tokenizer
from lightning_memrl.predict import check_predict_workflow, predict_rows, prediction_writers
from lightning_memrl.resume import ExactResume
from lightning_memrl.rewards import ExactMatch, RewardFunction, check_answer_pattern
from lightning_memrl.rollout.base import RolloutBackend, RolloutBackendFactory, check_backend
from lightning_memrl.rollout.frozen import FrozenRolloutEngine, adapter_engine, load_reference_adapter, lora_reference
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.mode import generation_mode
from lightning_memrl.settings import GenerationSettings, GRPOSettings, OptimizerSettings, build_optimizer
from lightning_memrl.types import RolloutBatch, Task
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow

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
        quantization: 4-bit (NF4) or 8-bit base weights through bitsandbytes, trained with ``lora`` (QLoRA).
        gradient_checkpointing: recompute activations in the backward pass.
        workflow: how tasks become trajectories (default: MemAgent).
        rewards: reward functions, summed with their weights (default: exact match).
        advantage: how rewards become advantages (default: :class:`~lightning_memrl.advantages.GroupRelative`,
            GRPO's group-normalised reward); in YAML ``advantage: {class_path: ..., init_args: {...}}``.
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
        dynamic_sampling: DAPO's dynamic sampling (groups of equal rewards dropped, refilled with further
            tasks' groups, :class:`~lightning_memrl.credit.dynamic_sampling.DynamicSampling`); None: off.
        revision: branch, tag or commit of a hub model (``from_pretrained``'s, tokenizer too); None: its default.
        trust_remote_code: let ``from_pretrained`` run code from the model's repository (custom architectures).
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
        advantage: AdvantageEstimator | None = None,
        generation: GenerationSettings | None = None,
        val_max_new_tokens: int | None = None,
        answer_pattern: str | None = None,
        share_prefixes: bool = True,
        grpo: GRPOSettings | None = None,
        optimizer: OptimizerSettings | None = None,
        seed: int = 0,
        rollout: RolloutBackendFactory | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.model_name_or_path, self.dtype_name = model_name_or_path, dtype
        self.attn_implementation, self.lora = attn_implementation, lora
        self.gradient_checkpointing, self.seed = gradient_checkpointing, seed
        self.quantization, self.hub = quantization, {"revision": revision, "trust_remote_code": trust_remote_code}
        self.workflow = workflow or MemAgentWorkflow()
        self.reward_functions = rewards or [ExactMatch()]
        self.advantage = advantage or GroupRelative()
        self.generation = generation or GenerationSettings()
        self.val_max_new_tokens = val_max_new_tokens
        check_answer_pattern(answer_pattern, "model.init_args.answer_pattern")
        allocator.check_setting(os.environ)
        self.answer_pattern = answer_pattern
        self.share_prefixes = share_prefixes
        self.rollout_factory = rollout or partial(RolloutEngine, share_prefixes=share_prefixes)
        self.grpo = grpo or GRPOSettings()
        self.dynamic_sampling = dynamic_sampling
        self.optim = optimizer or OptimizerSettings()
        self._skips = guards.SkipCounter(self.grpo.max_consecutive_skipped_steps)
        names = [r.name for r in self.reward_functions]
        if len(set(names)) != len(names):
            raise ValueError(f"model.rewards: reward names must be unique, got {names}; set name: on each")
        self.policy: Any = None
        self.tokenizer: Any = None
        self.engine: RolloutBackend | None = None
        self._reference: Any = None  # not a registered submodule: kept out of checkpoints
        self.val_exact_match, self.val_f1, self.val_reward, self.val_bleu1 = (MeanMetric() for _ in range(4))
        self._evaluation = EvaluationLog()  # the validation/test epoch's tasks
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

        self.tokenizer = load_tokenizer(self.model_name_or_path, **self.hub)
        self.policy = self._load_model(mesh)
        needs_frozen = self.workflow.needs_frozen_model()
        if self.lora is not None and (self.grpo.kl_coef > 0 or needs_frozen):
            check_base_reference(self.policy, "grpo.kl_coef > 0" if self.grpo.kl_coef > 0 else "frozen agents")
        load_reference_adapter(self.policy, self.lora, self.grpo.kl_coef)  # no-op without that LoRA option
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
            return load_policy(
                self.model_name_or_path,
                self.tokenizer,
                self.dtype_name,
                self.attn_implementation,
                lora=None if reference else self.lora,
                gradient_checkpointing=self.gradient_checkpointing and not reference,
                seed=self.seed,
                quantization=None if reference else self.quantization,
                empty_weights=empty_weights,
                **self.hub,
            )

        if mesh is None:
            return build()
        strategy = self.trainer.strategy if self._trainer is not None else None
        shard_kwargs = strategy.fsdp_kwargs() if isinstance(strategy, distributed.FSDP2Strategy) else {}
        return distributed.load_sharded(build, mesh, **shard_kwargs)

    def frozen_engine(self) -> FrozenRolloutEngine:
        """A rollout engine over the model a workflow's frozen agents use: the LoRA base with the
        adapters disabled (or the saved ``lora.frozen_adapter_name_or_path``), else the reference."""
        lora, name = self.lora is not None, self.model_name_or_path
        if lora and (frozen_path := getattr(self.lora, "frozen_adapter_name_or_path", None)):
            return adapter_engine(self.policy, self.tokenizer, frozen_path, self.share_prefixes)
        return FrozenRolloutEngine(
            self.policy if lora else self._reference,
            self.tokenizer,
            f"the base model {name} with LoRA adapters disabled"
            if lora
            else f"a frozen copy of the initial weights of {name}",
            context=self.policy.disable_adapter if lora else None,
            share_prefixes=self.share_prefixes,
        )

    def reference_context(self) -> Any:
        """Context in which ``self.policy`` computes reference log-probs (LoRA: see ``lora_reference``)."""
        return lora_reference(self.policy) if self.lora is not None else nullcontext()

    def on_train_start(self) -> None:
        """Hand the rollout backend the policy's weights as training (or validation, testing) starts:
        they may have been loaded from a checkpoint or moved to their device after it was built."""
        self.engine.sync_weights(self.policy)

    on_validation_start = on_test_start = on_predict_start = on_train_start

    # ------------------------------------------------------------------ (b) (c) (g) overridable steps
    def rollout(self, tasks: list[Task], settings: GenerationSettings) -> RolloutBatch:
        """Run the workflow on ``tasks`` (group members already repeated) and flatten the turns."""
        frozen = self._reference if self.workflow.frozen_engine is not None else None  # the frozen agents' model
        with generation_mode(self.policy, frozen, self.device):
            trajectories = self.workflow.rollout(self.engine, tasks, settings)
        self.engine.release_memory()  # e.g. merged LoRA weights: not kept through the update
        if self.workflow.frozen_engine is not None:
            self.workflow.frozen_engine.release_memory()
        allocator.trim()  # the KV caches' freed heap pages back to the system before the update
        return RolloutBatch.from_trajectories(trajectories, self.grpo.group_size, self.engine.pad_id)

    def score(self, rollouts: RolloutBatch) -> None:
        """Fill ``rollouts.rewards`` [N] (weighted sum) and ``reward_components`` (name → [N]).

        A trajectory that every reward function leaves unscored (None) gets NaN; so does one for
        which a function returns NaN or ±inf (counted in ``self.nonfinite_rewards``). A value that
        is not a number stops the run with an error naming the function.
        """
        total, components, self.nonfinite_rewards = learner.score_trajectories(self.reward_functions, rollouts)
        rollouts.rewards, rollouts.reward_components = total, components

    # overridable: self.sequence_logprobs(model, prompts, response_ids [B, R], response_mask [B, R], with_entropy)
    # -> (log-probs [B, R], entropy [B, R] or None), and self.update(rollouts) -> metrics (ppo_epochs optimizer steps)
    sequence_logprobs = learner.sequence_logprobs
    update = learner.update

    # ------------------------------------------------------------------ training
    def training_step(self, batch: list[Task], batch_idx: int) -> None:
        """One GRPO step (see the module docstring for the phases)."""
        step_start = time.perf_counter()
        tasks = [task for task in batch for _ in range(self.grpo.group_size)]  # (a)
        rollouts = self.rollout(tasks, self.generation)  # (b)
        rollout_time = time.perf_counter() - step_start
        reward_stats = self._rewards(rollouts)  # (c) (d)
        if self.dynamic_sampling is not None:  # all-equal groups out, further tasks' groups in (none: empty batch)
            rollouts = self.dynamic_sampling.resample(self, rollouts, reward_stats, len(batch))
        self._advantages(rollouts)  # (e) (f)
        self._workflow_step(rollouts)  # the workflow's own modules (e.g. a reranker) and metrics
        update_start = time.perf_counter()
        stats = {**self.update(rollouts), **reward_stats}  # (g)
        timing = (rollout_time, time.perf_counter() - update_start, time.perf_counter() - step_start)
        self._log_step(rollouts, stats, timing)  # (h)

    def _rewards(self, rollouts: RolloutBatch) -> dict[str, float]:
        """(c) score, (d) the callbacks' ``on_rewards`` and the turn rewards summed in; ±inf becomes NaN, counted."""
        self.nonfinite_rewards = 0
        self.score(rollouts)
        scored = rollouts.rewards.clone()
        for callback in self._memrl_callbacks():
            callback.on_rewards(self.trainer, self, rollouts)
        shaped = rollouts.rewards.clone()
        shaped.index_add_(0, rollouts.turn_to_trajectory, rollouts.turn_rewards)
        return guards.guard_rewards(rollouts, shaped, scored, self.nonfinite_rewards, self.global_step)

    def _advantages(self, rollouts: RolloutBatch) -> None:
        """(e) the estimator's advantage per trajectory on every token of its turns; (f) ``on_advantages``."""
        assign_advantages(rollouts, self.advantage)
        metrics = getattr(self.advantage, "metrics", dict)()  # what the estimator measured, if anything
        if metrics:
            self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=rollouts.num_trajectories)
        for callback in self._memrl_callbacks():
            callback.on_advantages(self.trainer, self, rollouts)

    def _workflow_step(self, rollouts: RolloutBatch) -> None:
        """Backpropagate the workflow's ``module_loss`` (with the policy's first step); log ``step_metrics``."""
        loss, metrics = self.workflow.module_loss(rollouts), self.workflow.step_metrics(rollouts)
        if loss is not None:
            self.manual_backward(loss)
        if metrics:
            self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=rollouts.num_trajectories)

    def _memrl_callbacks(self) -> list[Any]:
        return [c for c in self.trainer.callbacks if isinstance(c, MemRLCallback)]

    def _log_step(self, rollouts: RolloutBatch, stats: dict[str, float], timing: tuple[float, float, float]) -> None:
        """(h) the step's metrics (``timing``: rollout, update and step seconds)."""
        lr = float(self.optimizers().param_groups[0]["lr"])
        metrics = step_metrics(rollouts, stats, lr, timing, self.grpo.ppo_epochs, self.grpo.kl_coef > 0)
        self.log_dict(metrics, batch_size=rollouts.num_trajectories, sync_dist=distributed.is_distributed())
        bar = console.progress_bar_metrics(metrics)  # reward, loss, KL, seconds per step
        self.log_dict(bar, prog_bar=True, logger=False, batch_size=rollouts.num_trajectories)
        log_step_completions(self, rollouts)  # grpo.log_completions: a table of sample completions

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: list[Task], batch_idx: int) -> None:
        """Greedy rollouts (``generation.num_generations_eval`` > 1: that many sampled per task) scored by
        exact match, token F1 and the training reward."""
        settings, n = self.generation.for_validation(self.val_max_new_tokens), self.generation.num_generations_eval
        with torch.no_grad():
            rollouts = self.rollout([task for task in batch for _ in range(n)], settings)
        self.score(rollouts)
        self.workflow.prepare_evaluation(rollouts.trajectories)
        for trajectory in rollouts.trajectories:
            em, f1 = self._evaluation.add(trajectory, self.answer_pattern, self.workflow)
            self.val_exact_match.update(em)
            self.val_f1.update(f1)
            self.val_bleu1.update(self._evaluation.bleu1_scores[-1])
        valid = rollouts.rewards[~torch.isnan(rollouts.rewards)]
        if valid.numel():
            self.val_reward.update(valid)
        self.log("val/exact_match", self.val_exact_match, prog_bar=True, batch_size=len(batch))
        self.log("val/f1", self.val_f1, batch_size=len(batch))
        self.log("val/bleu1", self.val_bleu1, batch_size=len(batch))
        self.log("val/reward", self.val_reward, batch_size=len(batch))

    test_step = validation_step

    def predict_step(self, batch: list[Task], batch_idx: int) -> list[dict[str, Any]]:
        """Greedy rollouts of unlabelled documents: one row per task (see ``lightning_memrl.predict``)."""
        return predict_rows(self, batch)

    def on_validation_epoch_start(self) -> None:
        self._evaluation = EvaluationLog()

    def on_validation_epoch_end(self) -> None:
        """Print the evaluation report and save it with one prediction per task (:meth:`EvaluationLog.write`)."""
        if self.trainer.sanity_checking:
            return
        step = self.global_step if self.trainer.state.fn == "fit" else self._checkpoint_step
        log_dir = self.trainer.log_dir or self.trainer.default_root_dir
        self._evaluation.write(step, self.model_name_or_path, log_dir, self.trainer.is_global_zero, self.loggers)

    on_test_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_validation_epoch_end

    # ------------------------------------------------------------------ optimisation and state
    def configure_optimizers(self) -> Any:
        """AdamW over the policy and the workflow's modules (at the workflow's ``module_lr``), and its schedule."""
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        return build_optimizer(
            self.optim, self.policy.parameters(), self.workflow_modules.parameters(), self.workflow.module_lr, total
        )

    def configure_callbacks(self) -> list[L.Callback]:
        """RNG states in checkpoints, and a checkpoint and exit code 143 on SIGTERM (see ``lightning_memrl.resume``);
        in ``predict``, a writer of ``predictions.jsonl`` unless the trainer has one.

        Also readies the console (:mod:`lightning_memrl.console`): INFO lines, the progress bar counting
        optimizer steps.
        """
        console.show_info_logs()
        console.quiet_known_noise()
        console.use_step_progress_bar(self.trainer)
        return [ExactResume(), *prediction_writers(self.trainer)]

    def setup(self, stage: str) -> None:
        if stage == "predict":
            check_predict_workflow(self.workflow)
        if self.dynamic_sampling is not None and stage == "fit":
            self.dynamic_sampling.setup(self.trainer.datamodule)  # refill tasks come from its training tasks

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        guards.check_finite_checkpoint(checkpoint)  # a NaN checkpoint would replace the last good one
        adapter_files.drop_frozen_base(self, checkpoint)  # LoRA: the adapters only; the base is re-loaded from its id
        checkpoint["memrl_workflow"] = self.workflow.state_dict()
        if self.dynamic_sampling is not None:
            checkpoint["memrl_dynamic_sampling"] = self.dynamic_sampling.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        adapter_files.restore_frozen_base(checkpoint, self, getattr(self._trainer, "ckpt_path", None))  # LoRA: the base
        self.workflow.load_state_dict(checkpoint.get("memrl_workflow", {}))
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.load_state_dict(checkpoint.get("memrl_dynamic_sampling", {}))
        self._checkpoint_step = int(checkpoint.get("global_step", 0))  # validate does not restore it
