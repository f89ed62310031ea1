"""Memory bank: entries an agent adds, updates and deletes, retrieved by BM25 or embeddings.

Memory-R1 and RMM keep a bank of short memory entries instead of one overwritten text. An entry
has an id, its text, the session and time it came from, and the ids of the source turns (LoCoMo
``dia_id``s), so evaluation can check whether retrieval surfaced the evidence. Operations are
``ADD`` / ``UPDATE`` / ``DELETE`` / ``NOOP``; a bad operation (unknown id, empty text) raises
:class:`MemoryBankError` and leaves the bank unchanged.

:class:`MemoryBank` lives in memory (its ``state_dict`` goes into checkpoints); the same bank kept
in one SQLite file is :class:`~lightning_memrl.memory.sqlite.SQLiteMemoryBank`. Dense retrieval
embeds texts with an :class:`~lightning_memrl.memory.embedders.Embedder`; a manager's output is
read into an operation by :func:`~lightning_memrl.memory.operations.parse_memory_operation`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from lightning_memrl.memory.embedders import Embedder, HashingEmbedder


class MemoryOp(str, Enum):
    """What a memory manager may do with one fact."""

    ADD = "ADD"
    UPDATE = "UPDATE"
    DELETE = "DELETE"
    NOOP = "NOOP"


class MemoryBankError(ValueError):
    """An operation that cannot be applied (unknown id, empty text, bad retriever)."""


@dataclass
class MemoryEntry:
    """One memory: its text and where it came from."""

    id: str
    text: str
    session: str = ""  # e.g. "session_3"
    time: str = ""  # e.g. "1:56 pm on 8 May, 2023"
    source_ids: list[str] = field(default_factory=list)  # e.g. LoCoMo dia_ids ["D3:4", "D3:5"]


class MemoryBank:
    """Memory entries with ADD / UPDATE / DELETE / NOOP and top-k retrieval.

    Args:
        retriever: ``bm25`` (the ``bm25s`` library, English stop words removed) or ``dense``
            (cosine similarity of ``embedder`` vectors).
        embedder: embeddings for ``dense`` retrieval (default: :class:`HashingEmbedder`).

    Example:
        >>> bank = MemoryBank()
        >>> entry = bank.add("Caroline went to a support group", source_ids=["D1:3"])
        >>> [e.id for e, _ in bank.retrieve("support group", k=1)]
        ['m0']
    """

    def __init__(self, retriever: str = "bm25", embedder: Embedder | None = None) -> None:
        if retriever not in ("bm25", "dense"):
            raise MemoryBankError(f"retriever must be 'bm25' or 'dense', got {retriever!r}")
        self.retriever = retriever
        self.embedder = embedder
        self._entries: dict[str, MemoryEntry] = {}  # insertion order = age
        self.next_id = 0
        self.op_counts: dict[str, int] = {op.value: 0 for op in MemoryOp}
        self._index: Any = None  # BM25 index or [n, dim] embeddings of the current entries
        self._index_ids: list[str] = []

    # ------------------------------------------------------------------ reading
    @property
    def entries(self) -> list[MemoryEntry]:
        """All entries, oldest first."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def get(self, entry_id: str) -> MemoryEntry:
        """The entry ``entry_id``; raises :class:`MemoryBankError` when there is none."""
        if entry_id not in self._entries:
            raise MemoryBankError(f"no memory with id {entry_id!r} (ids: {list(self._entries)[:10]}...)")
        return self._entries[entry_id]

    # ------------------------------------------------------------------ operations
    def add(self, text: str, session: str = "", time: str = "", source_ids: list[str] | None = None) -> MemoryEntry:
        """Store a new entry and return it (ids are ``m0``, ``m1``, ...)."""
        text = self._check_text(text)
        entry = MemoryEntry(f"m{self.next_id}", text, session, time, list(dict.fromkeys(source_ids or [])))
        self._write(upsert=entry, delete=None, next_id=self.next_id + 1, op=MemoryOp.ADD)
        return entry

    def update(
        self,
        entry_id: str,
        text: str,
        source_ids: list[str] | None = None,
        session: str | None = None,
        time: str | None = None,
    ) -> MemoryEntry:
        """Replace the text of ``entry_id``; new ``source_ids`` are appended to the old ones."""
        old = self.get(entry_id)
        text = self._check_text(text)
        entry = MemoryEntry(
            entry_id,
            text,
            old.session if session is None else session,
            old.time if time is None else time,
            list(dict.fromkeys(old.source_ids + list(source_ids or []))),
        )
        self._write(upsert=entry, delete=None, next_id=self.next_id, op=MemoryOp.UPDATE)
        return entry

    def delete(self, entry_id: str) -> MemoryEntry:
        """Remove ``entry_id`` and return what it held."""
        old = self.get(entry_id)
        self._write(upsert=None, delete=entry_id, next_id=self.next_id, op=MemoryOp.DELETE)
        return old

    def apply(
        self,
        op: MemoryOp | str,
        text: str = "",
        target_id: str | None = None,
        session: str = "",
        time: str = "",
        source_ids: list[str] | None = None,
    ) -> MemoryEntry | None:
        """Apply one operation; returns the entry added, updated or deleted (None for NOOP)."""
        try:
            op = MemoryOp(str(getattr(op, "value", op)).upper())
        except ValueError as err:
            raise MemoryBankError(f"unknown memory operation {op!r}; use ADD, UPDATE, DELETE or NOOP") from err
        if op is MemoryOp.ADD:
            return self.add(text, session, time, source_ids)
        if op in (MemoryOp.UPDATE, MemoryOp.DELETE) and not target_id:
            raise MemoryBankError(f"{op.value} needs the id of an existing memory")
        if op is MemoryOp.UPDATE:
            return self.update(str(target_id), text, source_ids, session or None, time or None)
        if op is MemoryOp.DELETE:
            return self.delete(str(target_id))
        self.op_counts[MemoryOp.NOOP.value] += 1
        return None

    def clear(self) -> None:
        """Remove every entry and reset ids and counters."""
        self.load_state_dict({"entries": [], "next_id": 0, "op_counts": {}})

    @staticmethod
    def _check_text(text: str) -> str:
        if not isinstance(text, str) or not text.strip():
            raise MemoryBankError("a memory needs non-empty text")
        return " ".join(text.split())

    def _write(self, upsert: MemoryEntry | None, delete: str | None, next_id: int, op: MemoryOp) -> None:
        """Commit one operation (subclasses persist it first, then call this)."""
        if upsert is not None:
            self._entries[upsert.id] = upsert
        if delete is not None:
            del self._entries[delete]
        self.next_id = next_id
        self.op_counts[op.value] += 1
        self._index = None

    # ------------------------------------------------------------------ retrieval
    def scores(self, query: str) -> list[tuple[MemoryEntry, float]]:
        """Every entry with its retrieval score for ``query`` (oldest first)."""
        if not self._entries:
            return []
        if self._index is None:
            self._build_index()
        ids = self._index_ids
        if self.retriever == "bm25":
            import bm25s

            tokens = bm25s.tokenize([query], stopwords="en", show_progress=False, return_ids=False)[0]
            values = (
                self._index.get_scores(tokens).tolist() if tokens and self._index is not False else [0.0] * len(ids)
            )
        else:
            query_vec = self._embedder().embed([query])[0]  # [dim]
            values = (self._index @ query_vec).tolist()  # [n]
        return [(self._entries[i], float(v)) for i, v in zip(ids, values)]

    def retrieve(self, query: str, k: int = 5, min_score: float | None = 0.0) -> list[tuple[MemoryEntry, float]]:
        """The ``k`` best entries for ``query``, best first (newer wins ties).

        Only entries scoring above ``min_score`` count (None: every entry, whatever its score).
        """
        scored = [(e, s, age) for age, (e, s) in enumerate(self.scores(query)) if min_score is None or s > min_score]
        scored.sort(key=lambda item: (-item[1], -item[2]))
        return [(e, s) for e, s, _ in scored[: max(k, 0)]]

    def _embedder(self) -> Embedder:
        if self.embedder is None:
            self.embedder = HashingEmbedder()
        return self.embedder

    def _build_index(self) -> None:
        self._index_ids = list(self._entries)
        texts = [self._entries[i].text for i in self._index_ids]
        if self.retriever == "bm25":
            import bm25s

            corpus = bm25s.tokenize(texts, stopwords="en", show_progress=False)
            if not corpus.vocab:  # only stop words: nothing can match
                self._index = False
                return
            index = bm25s.BM25()
            index.index(corpus, show_progress=False)
            self._index = index
        else:
            self._index = self._embedder().embed(texts)  # [n, dim]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Entries, the next id and the operation counters (plain Python types)."""
        return {
            "entries": [asdict(e) for e in self._entries.values()],
            "next_id": self.next_id,
            "op_counts": dict(self.op_counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the bank with what :meth:`state_dict` returned."""
        self._entries = {e["id"]: MemoryEntry(**e) for e in state["entries"]}
        self.next_id = int(state["next_id"])
        self.op_counts = {op.value: int(state.get("op_counts", {}).get(op.value, 0)) for op in MemoryOp}
        self._index = None

    def copy(self) -> MemoryBank:
        """An independent in-memory copy (same retriever and embedder)."""
        other = MemoryBank(self.retriever, self.embedder)
        other.load_state_dict(self.state_dict())
        return other

    def format(self, entries: list[MemoryEntry] | None = None, empty: str = "(no memories)") -> str:
        """Entries as prompt lines ``[m3] (8 May, 2023) text``."""
        entries = self.entries if entries is None else entries
        if not entries:
            return empty
        return "\n".join(f"[{e.id}]" + (f" ({e.time})" if e.time else "") + f" {e.text}" for e in entries)
