"""Loading the policy and its tokenizer: a hub id or local path, or ``tiny`` (random, offline) for tests.

Where a named model is read from (local folder, caches, the default model's GGUF file, the hub) is
decided by :func:`lightning_memrl.model_paths.resolve_model_path`.
"""

from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.adapter_files import adapter_base, check_adapter_loading, merge_adapter_folder
from lightning_memrl.adapters import LoraSettings, add_lora
from lightning_memrl.cast_loading import read_when_casting
from lightning_memrl.data.synthetic import synthetic_corpus
from lightning_memrl.model_paths import TINY, hub_options, loading_errors
from lightning_memrl.quantization import DTYPES, QuantizationSettings, check_quantization, prepare_quantized

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """Tokenizer of ``name_or_path`` (at ``revision``) with a pad token (EOS when it has none).

    ``revision`` and ``trust_remote_code`` go to ``from_pretrained`` (see :func:`hub_options`).
    """
    path, hub = hub_options(name_or_path, revision, trust_remote_code)
    if name_or_path == TINY:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    base = adapter_base(name_or_path)
    if base is not None and not (Path(name_or_path) / "tokenizer_config.json").is_file():
        return load_tokenizer(base, revision, trust_remote_code)  # an adapter folder without a tokenizer: its base's
    with loading_errors(name_or_path):
        tokenizer = AutoTokenizer.from_pretrained(path, **hub)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_pretrained(
    name_or_path: str,
    torch_dtype: torch.dtype,
    attn: str,
    quantization: QuantizationSettings | None,
    empty_weights: bool,
    hub: dict[str, Any],
) -> Any:
    """A saved model (hub id or local directory), quantised while loading, or its architecture on meta.

    ``hub``: ``revision`` and ``trust_remote_code`` for ``from_pretrained``, ``name_or_path`` already resolved.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    extra: dict[str, Any] = {}
    if quantization is not None:
        extra["quantization_config"] = quantization.to_bnb_config()
        if torch.cuda.is_available():  # quantise while loading onto this process's GPU
            extra["device_map"] = {"": torch.cuda.current_device()}
    with loading_errors(name_or_path):
        if empty_weights:
            config = AutoConfig.from_pretrained(name_or_path, **hub)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(
                    config, dtype=torch_dtype, attn_implementation=attn, trust_remote_code=hub["trust_remote_code"]
                )
        with read_when_casting(torch_dtype):  # a cast load reads each tensor once instead of mapping the file
            return AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=torch_dtype, attn_implementation=attn, **hub, **extra
            )


def _enable_gradient_checkpointing(model: Any, adapters: bool) -> None:
    """Recompute activations in backward (non-reentrant); with adapters the inputs need grads to reach them."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # generation turns it back on per call
    if adapters:
        model.enable_input_require_grads()


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
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """Load the policy, optionally with LoRA adapters, quantised base weights and gradient checkpointing.

    Args:
        name_or_path: hub id, local path (a saved model, or a LoRA adapter folder, merged into its base), or ``tiny``.
        tokenizer: the matching tokenizer (``tiny`` builds its vocabulary from it).
        dtype: ``auto`` (see :func:`resolve_dtype`), ``float32``, ``bfloat16`` or ``float16`` weights.
        attn_implementation: ``auto``, ``sdpa``, ``eager``, ``flash_attention_2``, ...
        lora: adapter settings, or None to train all weights.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        seed: weight seed of ``tiny``.
        quantization: 4-bit or 8-bit base weights (QLoRA); needs ``lora``.
        empty_weights: build the architecture on the meta device without reading weights (the
            sharded loader fills it from rank 0).
        revision: the hub model's branch, tag or commit (``from_pretrained``'s ``revision``).
        trust_remote_code: let ``from_pretrained`` run the model repository's own code.
    """
    torch_dtype = resolve_dtype(dtype, frozen_base=lora is not None)
    path, hub = hub_options(name_or_path, revision, trust_remote_code, torch_dtype)
    check_quantization(name_or_path, lora, quantization, empty_weights)
    attn = resolve_attn_implementation(attn_implementation)
    base = adapter_base(name_or_path)  # an exported LoRA adapter: its base with the adapter merged in
    if base is not None:
        check_adapter_loading(name_or_path, quantization, empty_weights)
        base_model = load_policy(
            base,
            tokenizer,
            dtype,
            attn_implementation,
            seed=seed,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
        model = merge_adapter_folder(name_or_path, base_model)
    elif name_or_path == TINY:
        with torch.device("meta") if empty_weights else nullcontext():
            model = build_tiny_model(tokenizer, seed=seed, dtype=torch_dtype)
        model.config._attn_implementation = attn
    else:
        model = _load_pretrained(path, torch_dtype, attn, quantization, empty_weights, hub)
    if quantization is not None:
        model = prepare_quantized(model, gradient_checkpointing)
    if gradient_checkpointing:
        _enable_gradient_checkpointing(model, adapters=lora is not None)
    if lora is not None:
        model = add_lora(model, lora, empty_weights)
    return model
