"""Memory bank: operations, retrieval ranking, state round trip, SQLite persistence and rollback."""

from __future__ import annotations

import sqlite3

import pytest
import torch

import lightning_memrl.memory as memory
from lightning_memrl.memory.bank import MemoryBank, MemoryBankError, MemoryOp
from lightning_memrl.memory.embedders import HashingEmbedder
from lightning_memrl.memory.operations import parse_memory_operation
from lightning_memrl.memory.sqlite import SQLiteMemoryBank


def _bank(bank: MemoryBank | None = None) -> MemoryBank:
    bank = bank if bank is not None else MemoryBank()
    bank.add("Caroline went to an LGBTQ support group", "session_1", "8 May, 2023", ["D1:3"])
    bank.add("Melanie painted a sunrise over the lake", "session_1", "8 May, 2023", ["D1:12"])
    bank.add("Melanie has two kids and a busy job", "session_2", "25 May, 2023", ["D2:1"])
    return bank


def test_operations_change_entries_ids_and_counts():
    bank = _bank()
    assert [e.id for e in bank.entries] == ["m0", "m1", "m2"]
    updated = bank.apply("update", "Melanie painted a sunrise in 2022", "m1", source_ids=["D1:14", "D1:12"])
    assert updated.text == "Melanie painted a sunrise in 2022"
    assert updated.source_ids == ["D1:12", "D1:14"]  # old ids kept first, duplicates dropped
    assert updated.session == "session_1"  # not given: kept
    assert bank.apply(MemoryOp.DELETE, target_id="m0").id == "m0"
    assert bank.apply("NOOP") is None
    added = bank.add("Caroline  wants to study\n psychology")
    assert added.id == "m3" and added.text == "Caroline wants to study psychology"  # ids never reused
    assert [e.id for e in bank.entries] == ["m1", "m2", "m3"]
    assert bank.op_counts == {"ADD": 4, "UPDATE": 1, "DELETE": 1, "NOOP": 1}


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda b: b.update("m9", "x"), "no memory with id 'm9'"),
        (lambda b: b.delete("m9"), "no memory with id 'm9'"),
        (lambda b: b.add("   "), "non-empty text"),
        (lambda b: b.apply("UPDATE", "x"), "UPDATE needs the id"),
        (lambda b: b.apply("RENAME", "x"), "unknown memory operation"),
    ],
)
def test_bad_operation_raises_and_leaves_the_bank_unchanged(call, message):
    bank = _bank()
    before = bank.state_dict()
    with pytest.raises(MemoryBankError, match=message):
        call(bank)
    assert bank.state_dict() == before


def test_bm25_ranks_the_matching_entry_first_and_skips_unrelated():
    bank = _bank()
    ranked = bank.retrieve("When did Melanie paint a sunrise?", k=3)
    assert [e.id for e, _ in ranked] == ["m1", "m2"]  # m0 shares no word: score 0, left out
    assert ranked[0][1] > ranked[1][1] > 0
    assert bank.retrieve("support group", k=1)[0][0].id == "m0"
    assert bank.retrieve("zebra", k=3) == []
    assert bank.retrieve("the a of", k=3) == []  # only stop words
    bank.update("m0", "Caroline adopted a sunrise painting")  # the index follows updates
    assert {e.id for e, _ in bank.retrieve("sunrise", k=5)} == {"m0", "m1"}
    assert MemoryBank().retrieve("anything") == []


def test_retrieval_of_a_bank_with_only_stop_words():
    bank = MemoryBank()
    bank.add("the of and")
    assert bank.retrieve("the", k=2) == []


def test_dense_retrieval_with_hashing_embedder():
    embedder = HashingEmbedder(dim=64)
    vectors = embedder.embed(["melanie sunrise", "melanie sunrise", "kids job"])  # [3, 64]
    assert vectors.shape == (3, 64)
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(3))
    assert torch.equal(vectors[0], vectors[1])
    bank = _bank(MemoryBank(retriever="dense", embedder=embedder))
    assert bank.retrieve("Melanie painted a sunrise", k=1)[0][0].id == "m1"
    with pytest.raises(MemoryBankError, match="'bm25' or 'dense'"):
        MemoryBank(retriever="tfidf")


def test_state_dict_round_trip_and_copy_are_independent():
    bank = _bank()
    bank.delete("m1")
    state = bank.state_dict()
    other = MemoryBank()
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.add("new").id == "m3"  # next_id restored, not recomputed from entries
    clone = bank.copy()
    clone.add("only in the copy")
    assert len(bank) == 2 and len(clone) == 3
    assert "[m2] (25 May, 2023) Melanie has two kids and a busy job" in bank.format()


def test_sqlite_bank_persists_across_instances(tmp_path):
    path = tmp_path / "mem" / "bank.sqlite"
    first = _bank(SQLiteMemoryBank(path))
    first.update("m2", "Melanie has three kids", ["D3:1"])
    first.delete("m0")
    first.close()
    second = SQLiteMemoryBank(path)
    assert [(e.id, e.text, e.source_ids) for e in second.entries] == [
        ("m1", "Melanie painted a sunrise over the lake", ["D1:12"]),
        ("m2", "Melanie has three kids", ["D2:1", "D3:1"]),
    ]
    assert second.add("fresh").id == "m3" and second.op_counts["DELETE"] == 1
    assert second.retrieve("three kids", k=1)[0][0].id == "m2"
    second.load_state_dict(MemoryBank().state_dict())
    second.close()
    assert len(SQLiteMemoryBank(path)) == 0


def test_sqlite_failed_operation_is_rolled_back(tmp_path):
    path = tmp_path / "bank.sqlite"
    bank = _bank(SQLiteMemoryBank(path))
    before = bank.state_dict()
    # the entry row is written, then the counter update aborts: the whole operation must vanish
    bank.conn.execute("CREATE TRIGGER boom BEFORE INSERT ON meta BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    with pytest.raises(sqlite3.IntegrityError, match="disk full"):
        bank.add("half written")
    with pytest.raises(sqlite3.IntegrityError):
        bank.update("m1", "half updated")
    assert bank.state_dict() == before  # in-memory view untouched
    bank.conn.execute("DROP TRIGGER boom")
    bank.close()
    assert SQLiteMemoryBank(path).state_dict() == before  # and so is the file


@pytest.mark.parametrize(
    "output, expected",
    [
        ('{"op": "ADD", "text": "Caroline likes hiking"}', (MemoryOp.ADD, None, "Caroline likes hiking", True)),
        ('Sure! {"operation": "update", "id": "m1", "memory": "new"} done', (MemoryOp.UPDATE, "m1", "new", True)),
        ('{"event": "DELETE", "id": "m0"}', (MemoryOp.DELETE, "m0", "", True)),
        ("UPDATE [m1]: Melanie painted in 2022", (MemoryOp.UPDATE, "m1", "Melanie painted in 2022", True)),
        ("MERGE m0 - Caroline went twice", (MemoryOp.UPDATE, "m0", "Caroline went twice", True)),
        ("ADD", (MemoryOp.ADD, None, "the fact", True)),  # no text: the fact itself
        ("noop", (MemoryOp.NOOP, None, "", True)),
        ("I think we should keep it", (MemoryOp.NOOP, None, "", False)),
        ('{"op": "RENAME", "id": "m1"}', (MemoryOp.NOOP, None, "", False)),
        ("DELETE m7", (MemoryOp.NOOP, None, "", False)),  # unknown id
        ('{"op": "UPDATE", "id": "m1"', (MemoryOp.UPDATE, "m1", "the fact", True)),  # broken JSON: the line form
        ("", (MemoryOp.NOOP, None, "", False)),
    ],
)
def test_parse_memory_operation_never_raises(output, expected):
    parsed = parse_memory_operation(output, {"m0", "m1"}, fact="the fact")
    assert (parsed.op, parsed.target_id, parsed.text, parsed.valid) == expected
    assert parsed.valid or parsed.problem


def test_memory_package_has_one_module_per_concern():
    homes = {
        "MemoryBank": "bank",
        "MemoryEntry": "bank",
        "MemoryOp": "bank",
        "MemoryBankError": "bank",
        "SQLiteMemoryBank": "sqlite",
        "Embedder": "embedders",
        "HashingEmbedder": "embedders",
        "SentenceTransformerEmbedder": "embedders",
        "ParsedOperation": "operations",
        "parse_memory_operation": "operations",
    }
    assert {name: getattr(memory, name).__module__ for name in homes} == {
        name: f"lightning_memrl.memory.{home}" for name, home in homes.items()
    }


def test_sentence_transformer_vectors_can_train_a_reranker():
    """encode() returns inference-mode tensors; the embedder's vectors must still enter autograd."""
    from lightning_memrl.memory.embedders import SentenceTransformerEmbedder
    from lightning_memrl.workflows.rmm_reranker import Reranker

    class InferenceModeEncoder:
        def encode(self, texts: list[str], **kwargs) -> torch.Tensor:
            with torch.inference_mode():
                return torch.nn.functional.normalize(torch.arange(1.0, 1 + 4 * len(texts)).view(len(texts), 4), dim=1)

    embedder = SentenceTransformerEmbedder.__new__(SentenceTransformerEmbedder)  # no model download: a stand-in
    embedder.model, embedder.dim = InferenceModeEncoder(), 4
    vectors = embedder.embed(["q", "m1", "m2"])  # [3, 4]
    assert not vectors.is_inference()
    reranker = Reranker(4)
    reranker(vectors[0], vectors[1:]).sum().backward()
    assert reranker.query_adapter.weight.grad is not None and reranker.query_adapter.weight.grad.abs().sum() > 0
