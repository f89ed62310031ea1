"""Tasks: task files, synthetic tasks, LoCoMo conversations and the Lightning datamodule that serves them."""

from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.files import load_tasks
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks

__all__ = [
    "LoCoMoSettings",
    "MemRLDataModule",
    "SyntheticTaskSettings",
    "generate_synthetic_tasks",
    "load_locomo",
    "load_tasks",
]
