"""The bank cache file: RMM's frozen reflection banks kept across runs, keyed by what built them."""

from __future__ import annotations

import json

import pytest
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine
from test_rmm import GREEDY, reply

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.memory.bank_cache import BankCacheFile, conversation_fingerprint
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow
from lightning_memrl.workflows.rmm import RMMWorkflow


def reflection_calls(engine: ScriptedEngine) -> int:
    return sum("List at most" in prompt for prompt, _ in engine.calls)


def evaluate(workflow: RMMWorkflow, engine: ScriptedEngine, tasks: list) -> list[tuple[str, str, list[str]]]:
    """One greedy rollout of the first task; the entries of the bank it answered from."""
    workflow.frozen_engine = engine
    workflow.rollout(engine, tasks[:1], GREEDY)
    bank = workflow._bank_cache[tasks[0].meta["conversation"].id]
    return [(e.id, e.text, e.source_ids) for e in bank.entries]


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path / "data"))


def test_a_second_workflow_reads_the_banks_instead_of_reflecting(tasks, tiny_tokenizer, tmp_path):
    cache = tmp_path / "banks" / "rmm.json"
    first_engine = ScriptedEngine(tiny_tokenizer, reply)
    built = evaluate(RMMWorkflow(bank_cache=str(cache)), first_engine, tasks)
    assert reflection_calls(first_engine) == 3 and len(built) == 4  # three sessions reflected, four topics
    (entry,) = json.loads(cache.read_text())["banks"].values()
    assert entry["conversation"] == tasks[0].meta["conversation"].id and len(entry["bank"]["entries"]) == 4

    second_engine = ScriptedEngine(tiny_tokenizer, reply)
    assert evaluate(RMMWorkflow(bank_cache=str(cache)), second_engine, tasks) == built
    assert reflection_calls(second_engine) == 0  # only the answer was generated
    assert len(second_engine.calls) == 1


def test_a_change_of_recipe_or_conversation_builds_again(tasks, tiny_tokenizer, tmp_path):
    cache = str(tmp_path / "rmm.json")
    evaluate(RMMWorkflow(bank_cache=cache), ScriptedEngine(tiny_tokenizer, reply), tasks)
    for workflow, data in [
        (RMMWorkflow(bank_cache=cache, max_topics=1), tasks),  # a reflection option
        (RMMWorkflow(bank_cache=cache, retriever="dense"), tasks),  # merges pick other candidates
        (RMMWorkflow(bank_cache=cache), load_locomo(write_locomo(tmp_path / "d2"), LoCoMoSettings(max_sessions=2))),
    ]:
        engine = ScriptedEngine(tiny_tokenizer, reply)
        evaluate(workflow, engine, data)
        assert reflection_calls(engine) > 0
    assert len(json.loads((tmp_path / "rmm.json").read_text())["banks"]) == 4  # each kept beside the others

    other_model = ScriptedEngine(tiny_tokenizer, reply)
    other_model.description = "the LoRA base with the adapter 'manager' switched on"
    evaluate(RMMWorkflow(bank_cache=cache), other_model, tasks)
    assert reflection_calls(other_model) == 3


def test_two_writers_keep_each_others_banks(tasks, tmp_path):
    conversation = tasks[0].meta["conversation"]
    other = load_locomo(write_locomo(tmp_path / "d2"), LoCoMoSettings(max_sessions=1))[0].meta["conversation"]
    assert conversation_fingerprint(conversation) != conversation_fingerprint(other)
    first, second = BankCacheFile(tmp_path / "c.json"), BankCacheFile(tmp_path / "c.json")
    first.put({"r": 1}, [(conversation, {"entries": [], "next_id": 1})], 2.0)
    second.put({"r": 1}, [(other, {"entries": [], "next_id": 7})], 4.0)
    assert first.get({"r": 1}, conversation) == {"entries": [], "next_id": 1}
    assert first.get({"r": 1}, other) == {"entries": [], "next_id": 7}
    assert first.get({"r": 2}, other) is None


def test_a_broken_file_names_itself_and_the_fix(tasks, tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"c\.json is not JSON .*delete it"):
        BankCacheFile(path).get({}, tasks[0].meta["conversation"])
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"c\.json has no 'banks' mapping"):
        BankCacheFile(path).get({}, tasks[0].meta["conversation"])


def test_a_workflow_whose_banks_are_not_file_cached_refuses_the_option(tmp_path):
    with pytest.raises(ValueError, match="bank_cache: MemoryR1Workflow does not keep its banks in a file"):
        MemoryR1Workflow(stage="answerer", bank_cache=str(tmp_path / "c.json"))


def test_a_trained_adapter_is_part_of_the_model_identity(tiny_tokenizer):
    from types import SimpleNamespace

    import torch

    from lightning_memrl.adapters import LoraSettings
    from lightning_memrl.memory.bank_cache import adapter_digest, model_identity
    from lightning_memrl.models import load_policy

    policy = load_policy("tiny", tiny_tokenizer, lora=LoraSettings(r=4))
    base_identity = model_identity(SimpleNamespace(model=policy))
    assert adapter_digest(policy) is None and "adapter" not in base_identity  # B = 0: the base model's banks
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).fill_(0.5)
    digest = adapter_digest(policy)
    assert digest is not None and len(digest) == 64
    assert model_identity(SimpleNamespace(model=policy)) == {**base_identity, "adapter": digest}
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_A" in n).add_(1.0)
    assert adapter_digest(policy) not in (None, digest)  # other weights, other banks
    frozen = SimpleNamespace(model=policy, description="the LoRA base with adapters disabled")
    assert "adapter" not in model_identity(frozen)  # a frozen engine is named by its description
