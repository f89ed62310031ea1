"""Workflows: how a task becomes a trajectory of turns (MemAgent, Memory-R1, RMM, or your own)."""

from lightning_memrl.workflows.bank import BankWorkflow
from lightning_memrl.workflows.base import Workflow
from lightning_memrl.workflows.memagent import MemAgentWorkflow
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow

__all__ = ["BankWorkflow", "MemAgentWorkflow", "MemoryR1Workflow", "RMMWorkflow", "Workflow"]
