"""Loading the policy: a hub id or local path, or ``tiny`` (random, offline) for tests."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

TINY = "tiny"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_attn_implementation(requested: str, device: torch.device | str = "cpu") -> str:
    """``auto`` → ``flash_attention_2`` on CUDA with flash-attn installed, else ``sdpa``."""
    if requested != "auto":
        return requested
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def build_tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained offline on the synthetic tasks' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lightning_memrl.data import synthetic_corpus

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

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except OSError as err:
        raise FileNotFoundError(
            f"model.init_args.model_name_or_path={name_or_path!r}: no tokenizer found ({err}). "
            "Pass a local directory with a saved model, a reachable hub id, or 'tiny'."
        ) from err
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str,
    tokenizer: Any,
    dtype: str = "float32",
    attn_implementation: str = "auto",
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
) -> Any:
    """Load the policy, optionally with LoRA adapters and gradient checkpointing.

    Args:
        name_or_path: hub id, local path, or ``tiny``.
        tokenizer: the matching tokenizer (``tiny`` builds its vocabulary from it).
        dtype: ``float32``, ``bfloat16`` or ``float16`` weights.
        attn_implementation: ``auto``, ``sdpa``, ``eager``, ``flash_attention_2``, ...
        lora: adapter settings, or None to train all weights.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        seed: weight seed of ``tiny``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    attn = resolve_attn_implementation(attn_implementation)
    if name_or_path == TINY:
        model = build_tiny_model(tokenizer, seed=seed, dtype=torch_dtype)
        model.config._attn_implementation = attn
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, attn_implementation=attn)
        except OSError as err:
            raise FileNotFoundError(
                f"model.init_args.model_name_or_path={name_or_path!r}: no model found ({err}). "
                "Pass a local directory with a saved model, a reachable hub id, or 'tiny'."
            ) from err
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # generation turns it back on per call
        if lora is not None:
            model.enable_input_require_grads()
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
    return model
