"""The Memory-SFT stage's data: Memory-R1 (:mod:`.targets`) or RMM generator (:mod:`.rmm_targets`) targets
built from LoCoMo annotations."""

from __future__ import annotations

import lightning as L
from torch.utils.data import DataLoader

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.errors import ConfigError, DataError
from lightning_memrl.sft.rmm_targets import build_rmm_answer_examples
from lightning_memrl.sft.targets import PARTS, SFTExample, build_sft_examples
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow


def _as_list(examples: list[SFTExample]) -> list[SFTExample]:
    return examples


class MemorySFTDataModule(L.LightningDataModule):
    """Supervised examples for the extractor, manager and answer agent of Memory-R1, or RMM's generator.

    Args:
        locomo_path: a LoCoMo JSON file or a folder of them (with ``session_N_observation`` annotations).
        locomo: which conversations and questions to use (``conversations`` lists the training ones:
            leave the held-apart conversation out).
        workflow: the workflow of the GRPO stage (its prompts, segments, caps and retriever): Memory-R1's,
            or RMM's (its generator answers and cites, see :mod:`lightning_memrl.sft.rmm_targets`).
        parts: agents to train: any of ``extract``, ``manage``, ``answer`` (RMM: ``answer`` only).
        batch_size: examples per optimizer step.
        shuffle: shuffle the examples every epoch (seeded by ``seed_everything``).
    """

    def __init__(
        self,
        locomo_path: str,
        locomo: LoCoMoSettings | None = None,
        workflow: MemoryR1Workflow | RMMWorkflow | None = None,
        parts: list[str] | None = None,
        batch_size: int = 4,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.init_args.batch_size must be >= 1, got {batch_size}")
        self.locomo_path, self.locomo = locomo_path, locomo or LoCoMoSettings()
        self.workflow = workflow or MemoryR1Workflow()
        self.parts = list(parts) if parts is not None else list(PARTS)
        if isinstance(self.workflow, RMMWorkflow) and self.parts != ["answer"]:
            raise ConfigError(
                f"data.init_args.parts must be [answer] with RMMWorkflow (its generator), got {self.parts}"
            )
        self.batch_size, self.shuffle = batch_size, shuffle
        self.examples: list[SFTExample] = []

    def setup(self, stage: str) -> None:
        if self.examples:
            return
        tasks = load_locomo(self.locomo_path, self.locomo)
        if isinstance(self.workflow, RMMWorkflow):
            self.examples, _ = build_rmm_answer_examples(self.workflow, tasks)
        else:
            self.examples, _ = build_sft_examples(self.workflow, tasks, self.parts)
        if not self.examples:
            raise DataError(f"{self.locomo_path}: no SFT example for parts {self.parts}; check data.init_args.parts")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.examples, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=_as_list)
