"""Memory stores: MemAgent's overwritten text memory and the entry bank that Memory-R1 and RMM edit."""

from lightning_memrl.memory.bank import MemoryBank, MemoryEntry, MemoryOp, SQLiteMemoryBank
from lightning_memrl.memory.text import TextMemoryStore

__all__ = ["MemoryBank", "MemoryEntry", "MemoryOp", "SQLiteMemoryBank", "TextMemoryStore"]
