"""GRPO and optimizer options of :class:`~lightning_memrl.module.MemRLModule`, checked when parsed."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from lightning_memrl.errors import ConfigError, check_option

log = logging.getLogger(__name__)

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "rollout_mean"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]
LossType = Literal["clip", "cispo"]
ImportanceSamplingLevel = Literal["token", "sequence"]


@dataclass
class GRPOSettings:
    """GRPO options, named as TRL and verl users know them (the advantage estimator is ``model.init_args.advantage``).

    Args:
        group_size: rollouts per task (``num_generations``).
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
        disable_dropout: set every dropout of the policy (LoRA's ``lora_dropout`` included) to 0 when
            the model is configured, as TRL does: with dropout the policy's log-probs are noisy,
            so ratios to the old policy differ from 1 before any update and clip spuriously. The
            old and reference log-probs are computed in eval mode (no dropout) either way.
        loss_type: the surrogate: ``clip`` (PPO's clipped ratio, with ``clip_low``/``clip_high``/
            ``dual_clip``) or ``cispo`` (MiniMax-M1, arXiv:2506.13585: ``-sg(min(ρ, 1 + clip_high))·A·log p``,
            every token keeps its gradient; no lower bound, as in the paper; TRL's ``loss_type="cispo"``,
            whose ``epsilon_high`` is the bound itself: TRL's 5.0 is ``clip_high: 4.0`` here).
        importance_sampling_level: ``token`` (a ratio per token) or ``sequence`` (GSPO, arXiv:2507.18071:
            one ratio per turn, ``s = exp(mean_t log ρ_t)`` over its response tokens, clipped to
            ``[1 - clip_low, 1 + clip_high]``; GSPO uses ``clip_low: 3.0e-4``, ``clip_high: 4.0e-4``), as TRL.
        top_entropy_quantile: train only the policy-gradient term of the tokens whose entropy is in
            this top fraction (Wang et al., arXiv:2506.01939 keep 0.2): a token counts when its entropy is
            at least the ``1 - q`` quantile of the micro-batch's response tokens, as TRL; the others keep
            their KL term and their place in the aggregation's denominator. 1.0 trains every token.
        mask_truncated_completions: turns that hit their token cap without ending get no loss at all
            (zero weight, and out of the aggregation's token counts), as TRL and DAPO's overlong filtering.
        skip_zero_advantage: run no forward or backward pass for a turn whose gradient is exactly zero:
            every trained token's advantage is 0 (a group of equal rewards) and neither ``kl_coef`` nor
            ``entropy_coef`` applies, or no token of it is trained (see
            :func:`~lightning_memrl.losses.rows_without_gradient`). The aggregation weights are computed over
            the whole batch first, so the gradient is the same; a step with every turn skipped still takes its
            ``ppo_epochs`` optimizer steps, on a zero gradient. ``train/skipped_tokens`` counts them.
        log_completions: log a table of the step's sample completions (task, the tail of the final
            prompt, completion, reward, advantage) to TensorBoard as the text ``completions``, every
            ``trainer.log_every_n_steps`` optimizer steps, as TRL.
        num_completions_to_print: how many trajectories that table shows (a step's first ones, so
            the members of its first groups side by side); None shows them all, as TRL.
    """

    group_size: int = 4
    loss_aggregation: LossAggregation = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    micro_batch_tokens: int = 8192
    max_grad_norm: float = 1.0
    max_consecutive_skipped_steps: int = 5
    disable_dropout: bool = True
    loss_type: LossType = "clip"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    top_entropy_quantile: float = 1.0
    mask_truncated_completions: bool = False
    skip_zero_advantage: bool = True
    log_completions: bool = False
    num_completions_to_print: int | None = None

    def __post_init__(self) -> None:
        p = "model.init_args.grpo."
        check_option(p + "group_size", self.group_size, 2, why="GRPO's advantage is relative to the group")
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
        check_choice(p + "loss_type", self.loss_type, ("clip", "cispo"))
        if self.num_completions_to_print is not None:
            check_option(p + "num_completions_to_print", self.num_completions_to_print, 1, why="null shows them all")
        check_choice(p + "importance_sampling_level", self.importance_sampling_level, ("token", "sequence"))
        check_option(
            p + "top_entropy_quantile", self.top_entropy_quantile, 0.0, 1.0, low_open=True, why="1 trains every token"
        )
        if self.loss_type == "cispo" and self.dual_clip is not None:
            raise ConfigError(
                f"{p}dual_clip bounds the clipped surrogate of loss_type 'clip'; loss_type 'cispo' has none: "
                "set dual_clip: null"
            )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` naming ``name`` and its choices unless ``value`` is one of them."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)} (got {value!r})")


@dataclass
class OptimizerSettings:
    """AdamW with linear warm-up then constant or cosine decay (transformers' schedules).

    The learning rate of optimizer step ``s`` (from 0) is ``lr * s / warmup_steps`` during warm-up (the
    first step at 0, as in transformers and TRL), then ``lr`` (``constant``) or
    ``lr * (0.1 + 0.9 * (1 + cos(pi * (s - warmup_steps) / (max_steps - warmup_steps))) / 2)`` (``cosine``,
    transformers' ``cosine_with_min_lr`` with ``min_lr_rate=0.1``).

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


def build_optimizer(
    o: OptimizerSettings,
    params: Iterable[torch.nn.Parameter],
    module_params: Iterable[torch.nn.Parameter],
    module_lr: float | None,
    total: int | None,
) -> dict[str, Any]:
    """AdamW and its warm-up/decay schedule over ``total`` steps (None: unknown).

    Args:
        o: the optimizer settings.
        params: the policy's parameters (those without ``requires_grad`` are left out).
        module_params: a workflow's own modules' parameters, trained at ``module_lr`` (None: ``o.lr``).
        module_lr: their learning rate.
        total: the number of optimizer steps of the run, for the cosine schedule.

    Returns:
        Lightning's ``configure_optimizers`` answer: the optimizer and a per-step LR scheduler.
    """
    groups: list[dict[str, Any]] = [{"params": [p for p in params if p.requires_grad]}]
    extra = [p for p in module_params if p.requires_grad]
    if extra:  # the workflow's own modules, at their own learning rate
        groups.append({"params": extra, "lr": module_lr or o.lr})
    every = [p for group in groups for p in group["params"]]
    # The fused kernel is one pass over each tensor; the default on CPU is a Python loop over
    # parameters that cost 0.9 s of a 9.8 s full fine-tuning step of SmolLM2 on 2 cores.
    fused = bool(every) and all(
        type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in every
    )  # sharded (DTensor) parameters keep the default implementation
    optimizer = torch.optim.AdamW(
        groups, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=fused or None
    )
    if o.schedule not in ("constant", "cosine"):
        raise ValueError(f"model.optimizer.schedule must be 'constant' or 'cosine', got {o.schedule!r}")
    from transformers.optimization import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    if o.schedule == "cosine" and total:  # transformers' schedules, as TRL's trainers use them
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, o.warmup_steps, total, min_lr_rate=0.1)
    else:
        if o.schedule == "cosine":
            log.warning(
                "model.optimizer.schedule 'cosine' needs --trainer.max_steps; the LR stays constant after warm-up"
            )
        scheduler = get_constant_schedule_with_warmup(optimizer, o.warmup_steps)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


_G = "model.init_args.generation."
RESERVED_GENERATE_KWARGS: dict[str, str] = {  # generate options set elsewhere -> where to set them
    **{k: _G + k for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_strings")},
    "max_new_tokens": _G + "max_new_tokens (validation: model.init_args.val_max_new_tokens)",
    "max_length": _G + "max_new_tokens",
    "do_sample": _G + "temperature (0 is greedy)",
    "num_return_sequences": "model.init_args.grpo.group_size (validation: " + _G + "num_generations_eval)",
    **dict.fromkeys(("num_beams", "num_beam_groups"), "nowhere: rollouts sample one response per prompt"),
    **dict.fromkeys(
        (
            "eos_token_id",
            "pad_token_id",
            "tokenizer",
            "return_dict_in_generate",
            "output_logits",
            "output_scores",
            "use_cache",
            "input_ids",
            "attention_mask",
            "inputs",
            "cache",
            "past_key_values",
            "generation_config",
        ),
        "the rollout engine",
    ),
}
SAMPLING_ONLY = frozenset({"typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"})  # ignored by greedy decoding


def check_generation_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` for a ``generation_kwargs`` key that another option sets, or that
    ``model.generate`` does not know (neither a ``transformers.GenerationConfig`` field nor an
    argument of ``generate``)."""
    if not kwargs:
        return
    from transformers import GenerationConfig, GenerationMixin

    known = set(GenerationConfig().to_dict()) | set(inspect.signature(GenerationMixin.generate).parameters)
    for key in kwargs:
        owner = RESERVED_GENERATE_KWARGS.get(key)
        if owner is not None:
            raise ConfigError(f"{_G}generation_kwargs.{key} is set by {owner}; remove it from generation_kwargs")
        if key not in known - {"self", "kwargs"}:
            raise ConfigError(
                f"{_G}generation_kwargs.{key} is not an option of transformers' generate (GenerationConfig): "
                "check its spelling"
            )


@dataclass
class GenerationSettings:
    """Sampling settings of the rollout engine.

    Args:
        temperature: sampling temperature; 0 means greedy. Log-probs use ``logits / temperature``
            (1 when greedy), and the update uses the same scaling.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep the k most likely tokens (0 = off).
        max_new_tokens: cap of one answer turn; memory turns are capped by the memory budget.
        max_prompt_length: longest prompt of a turn, in tokens; a longer prompt stops the run with a
            :class:`~lightning_memrl.errors.DataError` naming its task (it is never truncated). None:
            the model's ``max_position_embeddings`` minus the turn's new tokens.
        stop_strings: extra strings that end a response (kept in it, like EOS).
        min_p: keep the tokens whose probability (after temperature) is at least ``min_p`` times the
            most likely token's (TRL's ``min_p``); None or 0 disables it. Sampling only.
        repetition_penalty: divides the positive (multiplies the negative) logits of every token
            already in the prompt or the response, as ``transformers``' (TRL's ``repetition_penalty``);
            1.0 disables it. Applies to greedy turns (validation, frozen agents) too.
        generation_kwargs: further options of ``model.generate`` (TRL's ``generation_kwargs``), e.g.
            ``{no_repeat_ngram_size: 3}``. A key that one of the options above, ``grpo.group_size`` or
            the engine sets (``temperature``, ``max_new_tokens``, ``num_return_sequences``,
            ``eos_token_id``, ...) is refused, naming the option to use. Sampling-only keys
            (``typical_p``, ``epsilon_cutoff``, ...) are left out of greedy turns. None: none.
        num_generations_eval: responses per task at validation and test (TRL's ``num_generations_eval``).
            1: one greedy response. More: that many sampled with these settings (the
            ``val/*`` metrics average over them; needs ``temperature > 0``).

    ``min_p``, ``repetition_penalty``, ``top_p``, ``top_k`` and ``generation_kwargs`` choose which
    tokens are sampled; the log-probs recorded for the sampled tokens, and those of the update, stay
    the model's own ``log softmax(logits / temperature)``, as TRL computes its old log-probs with a
    forward pass of the model. ``train/logprob_gap`` therefore still measures only how far the
    trainer's numbers are from the sampler's for the same distribution (about 0), and the importance
    ratio starts at 1: the difference between the processed distribution the tokens came from and
    the model's is not corrected (the samples are slightly off-policy, as in TRL).
    """

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    max_prompt_length: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    num_generations_eval: int = 1

    def __post_init__(self) -> None:
        p = "model.init_args.generation."
        check_option(p + "temperature", self.temperature, 0.0, why="0 means greedy")
        check_option(p + "top_p", self.top_p, 0.0, 1.0, low_open=True, why="1 disables nucleus sampling")
        check_option(p + "top_k", self.top_k, 0, why="0 disables top-k")
        check_option(p + "max_new_tokens", self.max_new_tokens, 1)
        if self.min_p is not None:
            check_option(p + "min_p", self.min_p, 0.0, 1.0, why="null or 0 disables it")
        check_option(p + "repetition_penalty", self.repetition_penalty, 0.0, low_open=True, why="1 disables it")
        check_option(p + "num_generations_eval", self.num_generations_eval, 1)
        if self.num_generations_eval > 1 and self.temperature == 0:
            raise ConfigError(
                f"{p}num_generations_eval={self.num_generations_eval} samples several responses per task, but "
                f"{p}temperature is 0 (greedy: every sample would be the same): set a temperature > 0 or "
                "num_generations_eval: 1"
            )
        check_generation_kwargs(self.generation_kwargs or {})

    def greedy(self, max_new_tokens: int | None = None) -> GenerationSettings:
        """These settings without sampling (validation, frozen agents): the same caps and stop strings.

        Args:
            max_new_tokens: another answer cap (default: this one).
        """
        return GenerationSettings(
            temperature=0.0,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            max_prompt_length=self.max_prompt_length,
            stop_strings=self.stop_strings,
            repetition_penalty=self.repetition_penalty,
            generation_kwargs={k: v for k, v in (self.generation_kwargs or {}).items() if k not in SAMPLING_ONLY},
        )

    def for_validation(self, max_new_tokens: int | None = None) -> GenerationSettings:
        """The settings of validation and test turns: :meth:`greedy` when ``num_generations_eval`` is 1,
        else these sampling settings (with ``max_new_tokens``, when given, as the answer cap)."""
        if self.num_generations_eval == 1:
            return self.greedy(max_new_tokens)
        return replace(self, max_new_tokens=max_new_tokens or self.max_new_tokens)
