"""Memory-SFT: a supervised warm start of Memory-R1's agents before GRPO (``lightning-memrl fit``).

:class:`MemorySFTModule` trains the policy with token-level cross-entropy on the completion tokens
of :class:`~lightning_memrl.sft.targets.SFTExample` rows (prompt tokens are masked out), with the
same model options as :class:`~lightning_memrl.MemRLModule` (LoRA included). At the end of ``fit``
it writes the model to ``output_dir`` with ``save_pretrained``: the LoRA adapter (start GRPO from it
with ``model.init_args.lora.adapter_name_or_path: <output_dir>``) or, without LoRA, the whole model
and tokenizer (``model.init_args.model_name_or_path: <output_dir>``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_memrl.models import LoraSettings, load_policy, load_tokenizer
from lightning_memrl.settings import OptimizerSettings, build_optimizer
from lightning_memrl.sft.targets import SFTExample
from lightning_memrl.workflows.base import encode_chat_prompt

log = logging.getLogger(__name__)


IGNORE_INDEX = -100  # label of a token that is not trained (prompt, padding)


def tokenize_example(example: SFTExample, tokenizer: Any, max_length: int) -> tuple[list[int], list[int], bool]:
    """Token ids of prompt + completion (+ EOS), their labels (prompt masked), and whether the prompt was cut.

    The prompt is encoded as the RL rollout encodes it (:func:`encode_chat_prompt`). A sequence over
    ``max_length`` loses prompt tokens from its start; the completion is always kept whole.
    """
    prompt = encode_chat_prompt(example.prompt, tokenizer, example.system_prompt)
    target = tokenizer(example.target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    cut = len(prompt) + len(target) > max_length
    if cut:
        prompt = prompt[max(len(prompt) + len(target) - max_length, 0) :]
    return prompt + target, [IGNORE_INDEX] * len(prompt) + target, cut


def collate(examples: list[SFTExample], tokenizer: Any, max_length: int) -> tuple[dict[str, torch.Tensor], int]:
    """A right-padded batch (``input_ids``, ``attention_mask``, ``labels``) and how many prompts were cut."""
    rows = [tokenize_example(e, tokenizer, max_length) for e in examples]
    width = max(len(ids) for ids, _, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _, _ in rows])
    labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab, _ in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _, _ in rows])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}, sum(cut for _, _, cut in rows)


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (completion) tokens; position t predicts label t+1."""
    shifted = labels[:, 1:]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX
    )


class MemorySFTModule(L.LightningModule):
    """Supervised fine-tuning on Memory-R1's annotated targets (see the module docstring).

    Args:
        model_name_or_path: hub id, local path, or ``tiny`` (random, offline).
        revision: branch, tag or commit of a hub model; None: its default.
        trust_remote_code: let ``from_pretrained`` run the model repository's own code.
        dtype: weight dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        attn_implementation: ``auto``, ``sdpa``, ``eager``, ``flash_attention_2``.
        lora: LoRA adapter settings (as GRPO's); None trains every weight.
        gradient_checkpointing: recompute activations in backward.
        max_length: most tokens of prompt + completion (longer prompts lose their start; counted, logged).
        optimizer: AdamW and its schedule.
        output_dir: where ``fit`` saves the adapter (with LoRA) or the model and tokenizer; a relative path
            is under ``trainer.default_root_dir``; None: not saved.
    """

    def __init__(
        self,
        model_name_or_path: str = "tiny",
        revision: str | None = None,
        trust_remote_code: bool = False,
        dtype: str = "float32",
        attn_implementation: str = "auto",
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        max_length: int = 1024,
        optimizer: OptimizerSettings | None = None,
        output_dir: str | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"model.init_args.max_length must be >= 2, got {max_length}")
        self.save_hyperparameters()
        self.model_name_or_path, self.dtype_name, self.lora = model_name_or_path, dtype, lora
        self.hub = {"revision": revision, "trust_remote_code": trust_remote_code}
        self.attn_implementation, self.gradient_checkpointing = attn_implementation, gradient_checkpointing
        self.max_length, self.optim, self.output_dir = max_length, optimizer or OptimizerSettings(), output_dir
        self.policy: Any = None
        self.tokenizer: Any = None
        self.prompts_cut = 0

    def configure_model(self) -> None:
        """Load the tokenizer and the policy (with LoRA adapters when ``lora`` is set); idempotent."""
        if self.policy is not None:
            return
        self.tokenizer = load_tokenizer(self.model_name_or_path, **self.hub)
        self.policy = load_policy(
            self.model_name_or_path,
            self.tokenizer,
            dtype=self.dtype_name,
            attn_implementation=self.attn_implementation,
            lora=self.lora,
            gradient_checkpointing=self.gradient_checkpointing,
            **self.hub,
        )

    def training_step(self, batch: list[SFTExample], batch_idx: int) -> torch.Tensor:
        """Cross-entropy on the completion tokens of ``batch`` (a list of examples)."""
        tensors, cut = collate(batch, self.tokenizer, self.max_length)
        if cut:
            self.prompts_cut += cut
            log.warning("SFT: %d prompts longer than max_length=%d lost their start", cut, self.max_length)
        tensors = {k: v.to(self.device) for k, v in tensors.items()}
        logits = self.policy(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        loss = completion_loss(logits, tensors["labels"])
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch))
        self.log("train/completion_tokens", float((tensors["labels"] != IGNORE_INDEX).sum()), batch_size=len(batch))
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW over the trainable weights (the adapters with LoRA) and its schedule."""
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        return build_optimizer(self.optim, self.policy.parameters(), [], None, total)

    def on_train_end(self) -> None:
        """Save the adapter (LoRA) or the model and tokenizer to ``output_dir`` for the GRPO stage."""
        if self.output_dir is None or not self.trainer.is_global_zero:
            return
        out = Path(self.trainer.default_root_dir) / self.output_dir  # an absolute output_dir stays as it is
        out.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(out)
        if self.lora is None:
            self.tokenizer.save_pretrained(out)
        log.info("SFT: %s saved to %s", "LoRA adapter" if self.lora else "model and tokenizer", out)
