"""lightning_memrl: train memory-augmented LLM agents with reinforcement learning on Lightning."""

from lightning_memrl.data import MemRLDataModule, SyntheticTaskConfig, Task, generate_synthetic_tasks, load_tasks
from lightning_memrl.memory import TextMemoryStore
from lightning_memrl.models import LoraSettings
from lightning_memrl.module import GRPOSettings, MemRLModule, OptimizerSettings
from lightning_memrl.rollout import GenerationSettings, RolloutEngine
from lightning_memrl.workflow import MemAgentWorkflow, RolloutBatch, Trajectory, Turn, Workflow

__version__ = "0.1.0"
__all__ = [
    "GRPOSettings",
    "GenerationSettings",
    "LoraSettings",
    "MemAgentWorkflow",
    "MemRLDataModule",
    "MemRLModule",
    "OptimizerSettings",
    "RolloutBatch",
    "RolloutEngine",
    "SyntheticTaskConfig",
    "Task",
    "TextMemoryStore",
    "Trajectory",
    "Turn",
    "Workflow",
    "generate_synthetic_tasks",
    "load_tasks",
]
