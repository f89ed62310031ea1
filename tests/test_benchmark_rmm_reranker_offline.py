"""benchmarks/rmm_reranker_offline.py: leave-one-conversation-out training of RMM's reranker on cached banks."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from locomo_fixture import locomo_conversation, write_locomo, write_two_conversations

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.memory.bank import MemoryBank
from lightning_memrl.memory.bank_cache import BankCacheFile
from lightning_memrl.memory.embedders import HashingEmbedder
from lightning_memrl.workflows.bank import conversation_of
from lightning_memrl.workflows.rmm_reranker import standardised

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
FACTS = [  # (memory, its source turns) of the fixture's dialogue
    ("Ana adopted a cat named Miso.", ["D1:1"]),
    ("Ben started learning the violin.", ["D1:2"]),
    ("Ben moved to Lisbon.", ["D2:2"]),
    ("Ben's violin teacher is Rosa.", ["D3:1"]),
]

QUESTIONS = {  # the fixture's questions of categories 1-4 and their evidence turns
    "What is the name of Ana's cat?": ["D1:1"],
    "Where did Ben move?": ["D2:2"],
    "In what year did Ana adopt a cat?": ["D1:1"],
    "Who teaches Ben?": ["D3:1", "D1:2"],
}


def _top1_recall(bank: MemoryBank) -> float:
    """Mean Recall@1 of the evidence over :data:`QUESTIONS` when ``bank`` (filled with :data:`FACTS`) keeps its best."""
    for text, sources in FACTS:
        bank.add(text, "session_1", "", sources)
    recalls = []
    for question, evidence in QUESTIONS.items():
        top = bank.retrieve(question, 1, None)[0][0]
        recalls.append(sum(e in top.source_ids for e in evidence) / len(evidence))
    return sum(recalls) / len(recalls)


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("rmm_reranker_offline")
    monkeypatch.setattr(module.bu, "RESULTS", tmp_path / "results")
    return module


def _conversation(args, name: str) -> Any:
    """Conversation ``name`` of ``args.locomo`` as the benchmark loads it."""
    return conversation_of(load_locomo(args.locomo, LoCoMoSettings(conversations=[name]))[0])


def _write_banks(bench, path: Path, names=(("conv-a", "Ana"), ("conv-b", "Eva")), *options: str) -> None:
    """Banks of :data:`FACTS` (Ana renamed) in the workflow's bank cache ``path``, as the tiny model's."""
    args = bench._args(_argv(path.parent, "--top_m", "1", *options))
    recipe = importlib.import_module("rmm_banks").bank_recipe(args, bench.workflow_of(args))
    for conversation, name in names:
        bank = MemoryBank()
        for text, sources in FACTS:
            bank.add(text.replace("Ana", name), "session_1", "", sources)
        BankCacheFile(path).put(recipe, [(_conversation(args, conversation), bank.state_dict())], 1.5)


def _stored(bench, tmp_path: Path, name: str, *options: str) -> dict[str, Any] | None:
    """The bank cache's entry of conversation ``name`` built as ``options`` say."""
    args = bench._args(_argv(tmp_path, "--top_m", "1", *options))
    recipe = importlib.import_module("rmm_banks").bank_recipe(args, bench.workflow_of(args))
    return BankCacheFile(tmp_path / "banks.json").entry(recipe, _conversation(args, name))


def _write_third_conversation(tmp_path: Path) -> None:
    """``conv-c``: the fixture's dialogue with Ana renamed Ida, next to ``conv-a`` and ``conv-b``."""
    write_locomo(tmp_path / "data", "conv-c", json.loads(json.dumps(locomo_conversation()).replace("Ana", "Ida")))


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    data = write_two_conversations(tmp_path / "data")
    return [
        "--locomo", str(data), "--conversations", "conv-a", "conv-b", "--max_sessions", "0",
        "--embedding", "hashing", "--banks", str(tmp_path / "banks.json"), "--top_k", "4",
        "--model", "tiny", "--dtype", "float32", *extra,
    ]  # fmt: skip


def test_identity_recall_is_dense_retrieval_and_a_zero_learning_rate_gains_nothing(bench, tmp_path):
    _write_banks(bench, tmp_path / "banks.json")
    argv = _argv(tmp_path, "--top_m", "1", "--lrs", "0", "0.5", "--steps", "0", "3", "--seeds", "0", "1")
    result = bench.main(argv)
    assert result["questions"] == {"conv-a": 4, "conv-b": 4} and result["bank_sizes"] == {"conv-a": 4, "conv-b": 4}
    assert result["skipped"] == {"no evidence": 0, "no candidate": 0}
    # identity adapters score by the dot product of the embeddings: over all 4 memories that is dense retrieval
    embedder = HashingEmbedder(256)
    assert result["identity_recall"]["conv-a"] == pytest.approx(_top1_recall(MemoryBank("dense", embedder)))
    runs = {(r["lr"], r["steps"]): r for r in result["runs"]}
    assert set(runs) == {(0.0, 0), (0.0, 3), (0.5, 0), (0.5, 3)}
    for key in ((0.0, 0), (0.0, 3), (0.5, 0)):  # no step, or steps of size 0: still the identity
        assert runs[key]["gains"] == {"conv-a": [0.0, 0.0], "conv-b": [0.0, 0.0]} and runs[key]["mean_gain"] == 0.0
        assert runs[key]["mean_training_gain"] == 0.0
    written = json.loads((tmp_path / "results" / "rmm_reranker_offline.json").read_text())
    assert written["runs"] == json.loads(json.dumps(result["runs"]))
    assert "--conversations conv-a conv-b" in written["command"]


def test_keeping_every_candidate_recalls_all_evidence(bench, tmp_path):
    _write_banks(bench, tmp_path / "banks.json")
    result = bench.main(_argv(tmp_path, "--top_m", "4", "--lrs", "0.5", "--steps", "2", "--seeds", "0"))
    assert result["identity_recall"] == {"conv-a": 1.0, "conv-b": 1.0}
    assert result["first_stage_order_recall"] == {"conv-a": 1.0, "conv-b": 1.0}
    assert result["runs"][0]["gains"] == {"conv-a": [0.0], "conv-b": [0.0]}  # nothing left to reorder


def test_first_stage_feature_starts_as_the_identity_and_its_order_recall_is_the_first_stages(bench, tmp_path):
    _write_banks(bench, tmp_path / "banks.json")
    argv = _argv(tmp_path, "--top_m", "1", "--lrs", "0", "--steps", "3", "--seeds", "0", "--first_stage_feature")
    result = bench.main(argv)
    assert result["runs"][0]["gains"] == {"conv-a": [0.0], "conv-b": [0.0]}  # w and the adapters start at 0
    in_order = result["first_stage_order_recall"]["conv-a"]
    assert in_order == pytest.approx(_top1_recall(MemoryBank("bm25")))  # BM25's own best, no reranking
    assert in_order != result["identity_recall"]["conv-a"]  # here BM25's order is not the embeddings'


def test_banks_are_built_with_the_model_and_an_empty_bank_stops_with_a_message(bench, tmp_path):
    _write_banks(bench, tmp_path / "banks.json", (("conv-a", "Ana"), ("conv-b", "Eva")), "--dtype", "bfloat16")
    argv = _argv(tmp_path, "--top_m", "2", "--lrs", "0.1", "--steps", "1")  # float32: not the banks above
    with pytest.raises(SystemExit, match=r"no question of \['conv-a', 'conv-b'\] has first-stage candidates"):
        bench.main(argv)  # the tiny model's reflection writes no memory
    for name in ("conv-a", "conv-b"):
        built = _stored(bench, tmp_path, name)
        assert built["bank"]["entries"] == [] and built["build_s"] > 0 and built["conversation"] == name
        assert "{dialogue}" in built["recipe"]["options"]["reflect_template"]
        assert built["recipe"]["model"]["dtype"] == "torch.float32"
        assert len(_stored(bench, tmp_path, name, "--dtype", "bfloat16")["bank"]["entries"]) == 4  # kept


def test_held_apart_conversation_is_scored_once_with_the_best_leave_one_out_setting(bench, tmp_path):
    _write_third_conversation(tmp_path)
    _write_banks(bench, tmp_path / "banks.json", (("conv-a", "Ana"), ("conv-b", "Eva"), ("conv-c", "Ida")))
    argv = _argv(tmp_path, "--top_m", "1", "--objective", "supervised", "--lrs", "0", "0.05", "--steps", "40")
    result = bench.main([*argv, "--seeds", "0", "--questions_per_step", "3", "--held_apart", "conv-c"])
    assert all(set(run["gains"]) == {"conv-a", "conv-b"} for run in result["runs"])  # tuning never reads conv-c
    assert result["questions"]["conv-c"] == 4 and result["bank_sizes"]["conv-c"] == 4
    held = result["held_apart"]
    best = max(result["runs"], key=lambda run: run["mean_gain"])
    assert best["lr"] == 0.05 and held["chosen"] == {
        "lr": 0.05,
        "steps": 40,
        "mean_leave_one_out_gain": best["mean_gain"],
    }
    assert held["conversation"] == "conv-c" and held["questions"] == 4 and held["first_stage_recall"] == 1.0
    # the same facts under another name: what the labels taught on conv-a and conv-b holds on conv-c
    assert held["identity_recall"] < 3.5 / 4 and held["trained_recall"] == [pytest.approx(3.5 / 4)]
    assert held["mean_gain"] == pytest.approx(3.5 / 4 - held["identity_recall"])
    assert held["first_stage_order_recall"] == pytest.approx(_top1_recall(MemoryBank("bm25")))
    assert held["hand_set_recall"] == held["identity_recall"]  # no feature to set: the identity


def test_source_turn_feature_starts_as_the_identity_and_a_hand_set_weight_reads_the_dialogue(bench, tmp_path):
    _write_third_conversation(tmp_path)
    _write_banks(bench, tmp_path / "banks.json", (("conv-a", "Ana"), ("conv-b", "Eva"), ("conv-c", "Ida")))
    argv = _argv(tmp_path, "--top_m", "1", "--lrs", "0", "--steps", "3", "--seeds", "0", "--source_turn_feature")
    result = bench.main([*argv, "--held_apart", "conv-c"])
    assert result["runs"][0]["gains"] == {"conv-a": [0.0], "conv-b": [0.0]}  # w and the adapters start at 0
    held = result["held_apart"]
    assert held["trained_recall"] == [held["identity_recall"]]
    # by hand, with w = 1: each memory's summary match plus its one source turn's match, standardised
    turns = {"D1:1": "Ida: I adopted a cat named Miso.", "D1:2": "Ben: Nice! I started learning the violin.",
             "D2:2": "Ben: I moved to Lisbon last week.", "D3:1": "Ben: My violin teacher is called Rosa."}  # fmt: skip
    embed = HashingEmbedder(256).embed
    summaries = embed([text.replace("Ana", "Ida") for text, _ in FACTS])  # [K, D]
    sources = embed([turns[ids[0]] for _, ids in FACTS])  # [K, D]
    recalls = []
    for question, evidence in QUESTIONS.items():
        q = embed([question.replace("Ana", "Ida")])[0]
        best = int((summaries @ q + standardised(sources @ q)).argmax())
        recalls.append(sum(e in FACTS[best][1] for e in evidence) / len(evidence))
    assert held["hand_set_recall"] == pytest.approx(sum(recalls) / len(recalls))


def test_only_the_missing_conversations_bank_is_built(bench, tmp_path):
    _write_third_conversation(tmp_path)
    _write_banks(bench, tmp_path / "banks.json", (("conv-a", "Ana"), ("conv-b", "Eva")))
    argv = _argv(tmp_path, "--top_m", "1", "--held_apart", "conv-c")
    with pytest.raises(SystemExit, match=r"no question of \['conv-c'\] has first-stage candidates"):
        bench.main(argv)  # the tiny model's reflection writes no memory
    stored = {c: _stored(bench, tmp_path, c) for c in ("conv-a", "conv-b", "conv-c")}
    assert [len(entry["bank"]["entries"]) for entry in stored.values()] == [4, 4, 0]
    assert [entry["build_s"] for entry in stored.values()][:2] == [1.5, 1.5] and stored["conv-c"]["build_s"] > 0
