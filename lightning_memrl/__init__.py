"""lightning_memrl: train memory-augmented LLM agents with reinforcement learning on Lightning."""

from lightning_memrl import console
from lightning_memrl.adapters import LoraSettings
from lightning_memrl.advantages import AdvantageEstimator, GroupRelative
from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.files import load_tasks
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import ConfigError, DataError, MemRLError
from lightning_memrl.memory.bank import MemoryBank, MemoryEntry, MemoryOp
from lightning_memrl.memory.sqlite import SQLiteMemoryBank
from lightning_memrl.memory.text import TextMemoryStore
from lightning_memrl.module import MemRLModule
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings, GRPOSettings, OptimizerSettings
from lightning_memrl.types import RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

console.quiet_known_noise()  # one bitsandbytes line that every LoRA model's import of it prints

__version__ = "0.1.0"
__all__ = [
    "AdvantageEstimator",
    "ConfigError",
    "DataError",
    "MemRLError",
    "GRPOSettings",
    "GenerationSettings",
    "GroupRelative",
    "LoCoMoSettings",
    "LoraSettings",
    "MemAgentWorkflow",
    "MemRLDataModule",
    "MemRLModule",
    "MemoryBank",
    "MemoryEntry",
    "MemoryOp",
    "MemoryR1Workflow",
    "OptimizerSettings",
    "RMMWorkflow",
    "RolloutBatch",
    "RolloutBackend",
    "RolloutEngine",
    "SQLiteMemoryBank",
    "SyntheticTaskSettings",
    "Task",
    "TextMemoryStore",
    "Trajectory",
    "Turn",
    "Workflow",
    "generate_synthetic_tasks",
    "load_locomo",
    "load_tasks",
]
