"""Memory stores: MemAgent's overwritten text memory and the entry bank that Memory-R1 and RMM edit."""

from lightning_memrl.memory.bank import MemoryBank, MemoryBankError, MemoryEntry, MemoryOp
from lightning_memrl.memory.embedders import Embedder, HashingEmbedder, SentenceTransformerEmbedder
from lightning_memrl.memory.operations import ParsedOperation, parse_memory_operation
from lightning_memrl.memory.sqlite import SQLiteMemoryBank
from lightning_memrl.memory.text import TextMemoryStore

__all__ = [
    "Embedder",
    "HashingEmbedder",
    "MemoryBank",
    "MemoryBankError",
    "MemoryEntry",
    "MemoryOp",
    "ParsedOperation",
    "SQLiteMemoryBank",
    "SentenceTransformerEmbedder",
    "TextMemoryStore",
    "parse_memory_operation",
]
