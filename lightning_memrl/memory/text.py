"""Text memory: the bounded scratchpad a MemAgent-style agent overwrites each turn."""

from __future__ import annotations

from typing import Any


class TextMemoryStore:
    """One overwrite-only text memory per running trajectory, each capped at a token budget.

    The workflow resets the store at the start of a rollout (one slot per trajectory), then
    overwrites a slot with the tokens the agent wrote. Writes longer than the budget are cut and
    counted, so a run can report how often the agent overflowed its memory.

    Args:
        max_memory_tokens: budget of one memory in tokens.
        empty_text: what the prompt shows before anything was written.
    """

    def __init__(self, max_memory_tokens: int = 256, empty_text: str = "No previous memory.") -> None:
        if max_memory_tokens < 1:
            raise ValueError(f"max_memory_tokens must be >= 1, got {max_memory_tokens}")
        self.max_memory_tokens = max_memory_tokens
        self.empty_text = empty_text
        self.texts: list[str] = []
        self.token_counts: list[int] = []
        self.writes = 0
        self.truncated_writes = 0

    def reset(self, num_slots: int) -> None:
        """Start ``num_slots`` empty memories (lifetime counters are kept)."""
        self.texts = [""] * num_slots
        self.token_counts = [0] * num_slots

    def read(self, slot: int) -> str:
        """The memory of ``slot`` as prompt text."""
        return self.texts[slot] or self.empty_text

    def write(self, slot: int, token_ids: list[int], tokenizer: Any) -> str:
        """Overwrite ``slot`` with ``token_ids`` cut to the budget; returns the stored text."""
        self.writes += 1
        if len(token_ids) > self.max_memory_tokens:
            self.truncated_writes += 1
            token_ids = token_ids[: self.max_memory_tokens]
        text = tokenizer.decode(token_ids, skip_special_tokens=True).strip()
        self.texts[slot] = text
        self.token_counts[slot] = len(token_ids)
        return text

    def state_dict(self) -> dict[str, Any]:
        """Budget, current memories and lifetime counters."""
        return {
            "max_memory_tokens": self.max_memory_tokens,
            "texts": list(self.texts),
            "token_counts": list(self.token_counts),
            "writes": self.writes,
            "truncated_writes": self.truncated_writes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.max_memory_tokens = int(state["max_memory_tokens"])
        self.texts = list(state["texts"])
        self.token_counts = list(state["token_counts"])
        self.writes = int(state["writes"])
        self.truncated_writes = int(state["truncated_writes"])
