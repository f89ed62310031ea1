"""Memory-SFT: a supervised warm start of Memory-R1's agents from LoCoMo's annotations, before GRPO."""

from lightning_memrl.sft.data import MemorySFTDataModule
from lightning_memrl.sft.module import MemorySFTModule
from lightning_memrl.sft.targets import SFTExample, build_sft_examples

__all__ = ["MemorySFTDataModule", "MemorySFTModule", "SFTExample", "build_sft_examples"]
