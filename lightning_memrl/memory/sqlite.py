"""A memory bank kept in one SQLite file, every operation in one transaction.

A memory written by one process survives for the next, and a crash never leaves half an operation.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from lightning_memrl.memory.bank import MemoryBank, MemoryEntry, MemoryOp
from lightning_memrl.memory.embedders import Embedder


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
