"""Quantised base weights through bitsandbytes (QLoRA): 4-bit (NF4/FP4) or 8-bit (LLM.int8), frozen under LoRA."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memrl.errors import ConfigError
from lightning_memrl.model_paths import TINY

P = "model.init_args.quantization."
# weight dtypes by the name options give them (model dtype, bnb compute dtype, FSDP mixed precision)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class QuantizationSettings:
    """Load the base weights quantised by bitsandbytes (QLoRA); needs ``lora`` (quantised weights are frozen).

    The names follow transformers' ``BitsAndBytesConfig``.

    Args:
        load_in_4bit: 4-bit base weights. None: true unless ``load_in_8bit``.
        load_in_8bit: 8-bit (LLM.int8) base weights instead (bitsandbytes 0.50 runs them on CPU too;
            there the matrix products take float16 inputs).
        bnb_4bit_quant_type: ``nf4`` (QLoRA) or ``fp4``.
        bnb_4bit_compute_dtype: dtype of the de-quantised matrix products: ``bfloat16``, ``float16`` or ``float32``.
        bnb_4bit_use_double_quant: also quantise the quantisation constants (saves ~0.4 bit per weight).
    """

    load_in_4bit: bool | None = None
    load_in_8bit: bool = False
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_compute_dtype: str = "bfloat16"
    bnb_4bit_use_double_quant: bool = True

    def __post_init__(self) -> None:
        if self.load_in_4bit is None:
            self.load_in_4bit = not self.load_in_8bit
        if self.load_in_4bit == self.load_in_8bit:
            raise ConfigError(
                f"{P}load_in_4bit={self.load_in_4bit} and load_in_8bit={self.load_in_8bit}: choose one "
                "(set load_in_8bit: true alone for 8-bit, or drop quantization to load unquantised weights)"
            )
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ConfigError(f"{P}bnb_4bit_quant_type must be 'nf4' or 'fp4', got {self.bnb_4bit_quant_type!r}")
        if self.bnb_4bit_compute_dtype not in DTYPES:
            raise ConfigError(
                f"{P}bnb_4bit_compute_dtype must be one of {sorted(DTYPES)}, got {self.bnb_4bit_compute_dtype!r}"
            )

    @property
    def bits(self) -> int:
        """4 or 8 (settings saved before ``load_in_8bit`` existed are 4-bit)."""
        return 8 if getattr(self, "load_in_8bit", False) else 4

    def to_bnb_config(self) -> Any:
        """The matching ``transformers.BitsAndBytesConfig``."""
        from transformers import BitsAndBytesConfig

        self.__post_init__()  # settings unpickled from a checkpoint were not checked
        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=DTYPES[self.bnb_4bit_compute_dtype],
            bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
        )


def check_quantization(
    name_or_path: str, lora: Any, quantization: QuantizationSettings | None, empty_weights: bool
) -> None:
    """Refuse quantised base weights without adapters to train, or without a saved model to quantise."""
    if quantization is None:
        return
    if lora is None:
        raise ValueError(
            "model.init_args.quantization needs model.init_args.lora: quantised base weights cannot be trained; "
            "add e.g. lora: {r: 16, lora_alpha: 32}"
        )
    if name_or_path == TINY or empty_weights:
        raise ValueError(
            "model.init_args.quantization needs a saved model (a hub id or a local directory), "
            f"not {name_or_path!r}" + (" under sharding" if empty_weights else "")
        )


def keep_4bit_layout(model: Any) -> int:
    """Keep every bitsandbytes 4-bit weight of ``model`` in the layout it was quantised in.

    On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit weight into a CPU-kernel
    layout the first time its layer runs in eval mode without gradients (a rollout). That layout
    is for inference only: its kernel has no autograd formula (the gradient through the frozen
    base, which the adapters below it need, is dropped), it computes in bf16 whatever
    ``bnb_4bit_compute_dtype`` says (the rollout's log-probs then come from another model than
    the update's), and its inverse is lossy (the quantisation constants are rounded to bf16).
    A policy that trains therefore keeps the portable layout on every CPU: rollouts and updates
    run the same de-quantise-then-matmul kernel, and the 4-bit base stays bit for bit.

    Returns:
        the number of 4-bit layers.
    """
    from bitsandbytes.nn import Linear4bit

    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False  # read by Linear4bit.forward before it repacks
    return len(layers)


class _FirstTimeOnly(logging.Filter):
    """Let each message template through once: bitsandbytes' 8-bit layers log the same cast on every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.msg) not in self.seen
        self.seen.add(str(record.msg))
        return first


def prepare_quantized(model: Any, gradient_checkpointing: bool) -> Any:
    """QLoRA: the 4-bit layout kept, unquantised weights in fp32, input grads on, non-reentrant checkpointing."""
    from peft import prepare_model_for_kbit_training

    bnb_log = logging.getLogger("bitsandbytes.autograd._functions")  # "inputs will be cast ... to float16" per call
    if not any(isinstance(f, _FirstTimeOnly) for f in bnb_log.filters):
        bnb_log.addFilter(_FirstTimeOnly())
    keep_4bit_layout(model)
    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
