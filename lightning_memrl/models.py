"""Loading the policy and its tokenizer: a hub id or local path, or ``tiny`` (random, offline) for tests.

Where a named model is read from (local folder, caches, the default model's GGUF file, the hub) is
decided by :func:`lightning_memrl.model_paths.resolve_model_path`.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.adapters import adapter_base, check_adapter_loading, merge_adapter_folder
from lightning_memrl.data.synthetic import synthetic_corpus
from lightning_memrl.model_paths import TINY, missing_model_message, resolve_model_path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# weight dtypes by the name options give them (model dtype, bnb compute dtype, FSDP mixed precision)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoraSettings:
    """LoRA adapters (peft). With LoRA the reference model is the base with adapters disabled.

    Args:
        r: adapter rank.
        alpha: scaling numerator (``alpha / r`` multiplies the adapter output).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt; ``all-linear`` adapts every linear layer.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")


@dataclass
class QuantizationSettings:
    """Load the base weights quantised by bitsandbytes (QLoRA); needs ``lora`` (4-bit weights are frozen).

    The names follow transformers' ``BitsAndBytesConfig``.

    Args:
        load_in_4bit: 4-bit base weights.
        bnb_4bit_quant_type: ``nf4`` (QLoRA) or ``fp4``.
        bnb_4bit_compute_dtype: dtype of the de-quantised matrix products: ``bfloat16``, ``float16`` or ``float32``.
        bnb_4bit_use_double_quant: also quantise the quantisation constants (saves ~0.4 bit per weight).
    """

    load_in_4bit: bool = True
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_compute_dtype: str = "bfloat16"
    bnb_4bit_use_double_quant: bool = True

    def to_bnb_config(self) -> Any:
        """The matching ``transformers.BitsAndBytesConfig``."""
        from transformers import BitsAndBytesConfig

        if not self.load_in_4bit:
            raise ValueError("model.init_args.quantization.load_in_4bit must be true (4-bit QLoRA is supported)")
        if self.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ValueError(
                f"model.init_args.quantization.bnb_4bit_quant_type must be 'nf4' or 'fp4', "
                f"got {self.bnb_4bit_quant_type!r}"
            )
        if self.bnb_4bit_compute_dtype not in DTYPES:
            raise ValueError(
                f"model.init_args.quantization.bnb_4bit_compute_dtype must be one of {sorted(DTYPES)}, "
                f"got {self.bnb_4bit_compute_dtype!r}"
            )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=DTYPES[self.bnb_4bit_compute_dtype],
            bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
        )


def fast_bf16(device: torch.device | str | None = None) -> bool:
    """Whether bf16 matrix products are faster than fp32 on ``device`` (default: CUDA if present, else CPU).

    True on CUDA GPUs with bf16 support and on CPUs with AMX or AVX512-BF16. On other CPUs (e.g.
    AVX2-only) bf16 is emulated and many times slower than fp32.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def resolve_dtype(requested: str, frozen_base: bool, device: torch.device | str | None = None) -> torch.dtype:
    """Weight dtype from its name; ``auto`` picks the fastest correct one.

    ``auto`` gives bf16 only when the base weights are frozen (LoRA: the trainable adapters stay
    fp32, so no master copy is needed) and the hardware has fast bf16 (:func:`fast_bf16`);
    otherwise fp32, which full fine-tuning needs as master weights.

    Args:
        requested: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        frozen_base: the base weights are not trained (LoRA / QLoRA).
        device: where the model runs (default: CUDA if present, else CPU).
    """
    if requested == "auto":
        return torch.bfloat16 if frozen_base and fast_bf16(device) else torch.float32
    if requested not in DTYPES:
        raise ValueError(f"model.init_args.dtype must be 'auto' or one of {sorted(DTYPES)}, got {requested!r}")
    return DTYPES[requested]


def resolve_attn_implementation(requested: str, device: torch.device | str | None = None) -> str:
    """``auto`` → ``flash_attention_2`` on CUDA with flash-attn installed, else ``sdpa``.

    ``device`` defaults to CUDA when it is available.
    """
    if requested != "auto":
        return requested
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained offline on the synthetic tasks' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer: Any, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer Llama with random weights drawn from ``seed`` (same seed → same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype)


def load_tokenizer(name_or_path: str) -> Any:
    """Tokenizer of ``name_or_path`` with a pad token (EOS when it has none)."""
    if name_or_path == TINY:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    base = adapter_base(name_or_path)
    if base is not None and not (Path(name_or_path) / "tokenizer_config.json").is_file():
        return load_tokenizer(base)  # an adapter folder without a tokenizer: its base's
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    except OSError as err:
        raise FileNotFoundError(missing_model_message(name_or_path, err)) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def _check_quantization(
    name_or_path: str, lora: LoraSettings | None, quantization: QuantizationSettings | None, empty_weights: bool
) -> None:
    """Refuse 4-bit base weights without adapters to train, or without a saved model to quantise."""
    if quantization is not None and lora is None:
        raise ValueError(
            "model.init_args.quantization needs model.init_args.lora: 4-bit base weights cannot be trained; "
            "add e.g. lora: {r: 16, alpha: 32}"
        )
    if quantization is not None and (name_or_path == TINY or empty_weights):
        raise ValueError(
            "model.init_args.quantization needs a saved model (a hub id or a local directory), "
            f"not {name_or_path!r}" + (" under sharding" if empty_weights else "")
        )


def _load_pretrained(
    name_or_path: str,
    torch_dtype: torch.dtype,
    attn: str,
    quantization: QuantizationSettings | None,
    empty_weights: bool,
) -> Any:
    """A saved model (hub id or local directory), quantised while loading, or its architecture on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra: dict[str, Any] = {}
    if quantization is not None:
        extra["quantization_config"] = quantization.to_bnb_config()
        if torch.cuda.is_available():  # quantise while loading onto this process's GPU
            extra["device_map"] = {"": torch.cuda.current_device()}
    try:
        if empty_weights:
            config = AutoConfig.from_pretrained(resolve_model_path(name_or_path))
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
        return AutoModelForCausalLM.from_pretrained(
            resolve_model_path(name_or_path), dtype=torch_dtype, attn_implementation=attn, **extra
        )
    except OSError as err:
        raise FileNotFoundError(missing_model_message(name_or_path, err)) from err


def _prepare_4bit(model: Any, gradient_checkpointing: bool) -> Any:
    """QLoRA: the 4-bit layout kept, unquantised weights in fp32, input grads on, non-reentrant checkpointing."""
    from peft import prepare_model_for_kbit_training

    keep_4bit_layout(model)
    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def _enable_gradient_checkpointing(model: Any, adapters: bool) -> None:
    """Recompute activations in backward (non-reentrant); with adapters the inputs need grads to reach them."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # generation turns it back on per call
    if adapters:
        model.enable_input_require_grads()


def _add_lora(model: Any, lora: LoraSettings, empty_weights: bool) -> Any:
    """``model`` wrapped by peft with LoRA adapters (built on meta when the weights are empty)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    with torch.device("meta") if empty_weights else nullcontext():
        return get_peft_model(model, config)


def load_policy(
    name_or_path: str,
    tokenizer: Any,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    quantization: QuantizationSettings | None = None,
    empty_weights: bool = False,
) -> Any:
    """Load the policy, optionally with LoRA adapters, 4-bit base weights and gradient checkpointing.

    Args:
        name_or_path: hub id, local path (a saved model, or a LoRA adapter folder, merged into its base), or ``tiny``.
        tokenizer: the matching tokenizer (``tiny`` builds its vocabulary from it).
        dtype: ``auto`` (see :func:`resolve_dtype`), ``float32``, ``bfloat16`` or ``float16`` weights.
        attn_implementation: ``auto``, ``sdpa``, ``eager``, ``flash_attention_2``, ...
        lora: adapter settings, or None to train all weights.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        seed: weight seed of ``tiny``.
        quantization: 4-bit base weights (QLoRA); needs ``lora``.
        empty_weights: build the architecture on the meta device without reading weights (the
            sharded loader fills it from rank 0).
    """
    _check_quantization(name_or_path, lora, quantization, empty_weights)
    torch_dtype = resolve_dtype(dtype, frozen_base=lora is not None)
    attn = resolve_attn_implementation(attn_implementation)
    base = adapter_base(name_or_path)  # an exported LoRA adapter: its base with the adapter merged in
    if base is not None:
        check_adapter_loading(name_or_path, quantization, empty_weights)
        model = merge_adapter_folder(name_or_path, load_policy(base, tokenizer, dtype, attn_implementation, seed=seed))
    elif name_or_path == TINY:
        with torch.device("meta") if empty_weights else nullcontext():
            model = build_tiny_model(tokenizer, seed=seed, dtype=torch_dtype)
        model.config._attn_implementation = attn
    else:
        model = _load_pretrained(name_or_path, torch_dtype, attn, quantization, empty_weights)
    if quantization is not None:
        model = _prepare_4bit(model, gradient_checkpointing)
    if gradient_checkpointing:
        _enable_gradient_checkpointing(model, adapters=lora is not None)
    if lora is not None:
        model = _add_lora(model, lora, empty_weights)
    return model
