"""RMM's generator warm start: answer + citation targets from the LoCoMo fixture's annotated facts."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sft_fit_losses
from locomo_fixture import write_locomo

from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.errors import ConfigError
from lightning_memrl.sft.data import MemorySFTDataModule
from lightning_memrl.sft.rmm_targets import build_rmm_answer_examples, observation_bank
from lightning_memrl.workflows.rmm import RMMWorkflow
from lightning_memrl.workflows.rmm_reranker import parse_citations

REPO = Path(__file__).resolve().parents[1]
# the fixture's annotated facts hold these evidence turns: m0 D1:1, m1 D1:2, m2 D2:1, m3 D2:2, m4 D2:2 (the
# "Violin" fact cites D2:2), m5 D3:1 + D1:2, m6 D9:9; so each question's evidence lies in these memories:
HOLDERS = {"conv-test:qa0": {"m0"}, "conv-test:qa1": {"m3", "m4"}, "conv-test:qa2": {"m0"}}
HOLDERS["conv-test:qa3"] = {"m1", "m5"}
GOLD = {"conv-test:qa0": "Miso", "conv-test:qa1": "Lisbon", "conv-test:qa2": "2023", "conv-test:qa3": "Rosa"}


def test_targets_cite_the_displayed_numbers_of_the_memories_holding_the_evidence(tmp_path):
    tasks = load_locomo(write_locomo(tmp_path))
    workflow = RMMWorkflow(top_k=5, top_m=3)
    bank = observation_bank(workflow, tasks[0].meta["conversation"])
    assert [(e.id, e.source_ids) for e in bank.entries][4:] == [("m4", ["D2:2"]), ("m5", ["D3:1", "D1:2"])] + [
        ("m6", ["D9:9"])
    ]
    examples, counts = build_rmm_answer_examples(workflow, tasks, seed=0)
    assert [e.source for e in examples] == list(GOLD)  # category 5 is not in the tasks
    orders = set()
    for example in examples:
        shown = example.meta["shown_ids"]
        cited = [j + 1 for j, entry_id in enumerate(shown) if entry_id in HOLDERS[example.source]]
        assert len(shown) == 3 and cited, (example.source, shown)  # BM25's top 3 holds the evidence here
        assert example.target == f"Answer: \\boxed{{{GOLD[example.source]}}}\nCitations: {cited}"
        assert parse_citations(example.target, 3) == {n - 1 for n in cited}  # the RL stage reads them back
        orders.add(tuple(shown))
    miso = examples[0]
    position = miso.meta["shown_ids"].index("m0") + 1
    assert f"[{position}] (1:00 pm on 3 May, 2023) Ana adopted a cat named Miso.\n    [D1:1] Ana:" in miso.prompt
    assert miso.prompt.startswith("Memories from a conversation between Ana and Ben:")
    assert "Question: What is the name of Ana's cat?" in miso.prompt
    assert counts["answer"] == 4 and counts["citations"] == sum(len(e.meta["cited"]) for e in examples)
    assert counts["answers_without_evidence_memory"] == 0
    assert build_rmm_answer_examples(workflow, tasks, seed=0)[0] == examples  # seeded
    assert len(orders) == 4  # shown in a random order, as the RL stage shows them while training


def test_rmm_takes_only_the_answer_part():
    with pytest.raises(ConfigError, match=r"parts must be \[answer\] with RMMWorkflow"):
        MemorySFTDataModule("data.json", workflow=RMMWorkflow(), parts=["extract", "answer"])


def test_rmm_sft_fit_through_the_cli_lowers_the_loss_and_saves_the_adapter(tmp_path):
    data = write_locomo(tmp_path / "data")
    args = ["--data.init_args.locomo_path", str(data), "--data.init_args.batch_size", "4", "--trainer.max_steps", "3"]
    losses = sft_fit_losses(tmp_path, REPO / "configs" / "rmm" / "sft.yaml", "logs/rmm_sft", *args)
    assert len(losses) == 3 and losses[2] < losses[0] - 0.05, losses  # the same 4 answer examples each step
    assert (tmp_path / "logs/rmm_sft/adapter/adapter_config.json").is_file()
