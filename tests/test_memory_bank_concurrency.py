"""SQLiteMemoryBank.reload while another process writes: one consistent snapshot, never "database is locked"."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3

from lightning_memrl.memory.sqlite import SQLiteMemoryBank

WRITES = 1200


def _hammer(path: str, writes: int, ready) -> None:
    """Add facts as fast as SQLite allows, deleting the oldest after every third add."""
    bank = SQLiteMemoryBank(path)
    bank.conn.execute("PRAGMA synchronous=OFF")  # no fsync: more commits land between a reader's statements
    ready.set()
    for i in range(writes):
        bank.add(f"fact number {i} about the garden")
        if i % 3 == 2:
            bank.delete(bank.entries[0].id)
    bank.close()


def test_reload_is_consistent_while_another_process_writes(tmp_path):
    path = str(tmp_path / "bank.sqlite")
    SQLiteMemoryBank(path).close()
    context = mp.get_context("spawn")
    ready = context.Event()
    writer = context.Process(target=_hammer, args=(path, WRITES, ready))
    writer.start()
    # the writer imports the package first: on a loaded machine that alone has taken over a minute
    assert ready.wait(300), "the writer process did not start within 300 s"
    reader = SQLiteMemoryBank(path)
    reloads, inconsistent, locked = 0, [], []
    while writer.is_alive() or reloads == 0:
        try:
            reader.reload()
        except sqlite3.OperationalError as err:
            locked.append(str(err))
            continue
        reloads += 1
        adds, deletes = reader.op_counts["ADD"], reader.op_counts["DELETE"]
        ids = [e.id for e in reader.entries]
        if len(ids) != adds - deletes or reader.next_id != adds or ids != [f"m{i}" for i in range(deletes, adds)]:
            inconsistent.append((len(ids), adds, deletes, reader.next_id))
    writer.join(300)
    assert writer.exitcode == 0  # the writer never met "database is locked" either
    assert reloads > 10, reloads
    assert not locked, locked[:3]
    assert not inconsistent, f"{len(inconsistent)} of {reloads} reloads inconsistent, e.g. {inconsistent[:3]}"
    reader.reload()
    assert len(reader) == WRITES - WRITES // 3 and reader.next_id == WRITES
    reader.close()
