"""lightning_memrl: train memory-augmented LLM agents with reinforcement learning on Lightning."""

from lightning_memrl.data import MemRLDataModule, SyntheticTaskConfig, Task, generate_synthetic_tasks, load_tasks
from lightning_memrl.errors import ConfigError, DataError, MemRLError
from lightning_memrl.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.memory import TextMemoryStore
from lightning_memrl.memory_bank import MemoryBank, MemoryEntry, MemoryOp, SQLiteMemoryBank
from lightning_memrl.memory_r1 import MemoryR1Workflow
from lightning_memrl.models import LoraSettings
from lightning_memrl.module import GRPOSettings, MemRLModule, OptimizerSettings
from lightning_memrl.rmm import RMMWorkflow
from lightning_memrl.rollout import GenerationSettings, RolloutEngine
from lightning_memrl.workflow import MemAgentWorkflow, RolloutBatch, Trajectory, Turn, Workflow

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DataError",
    "MemRLError",
    "GRPOSettings",
    "GenerationSettings",
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
    "RolloutEngine",
    "SQLiteMemoryBank",
    "SyntheticTaskConfig",
    "Task",
    "TextMemoryStore",
    "Trajectory",
    "Turn",
    "Workflow",
    "generate_synthetic_tasks",
    "load_locomo",
    "load_tasks",
]
