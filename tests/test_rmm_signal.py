"""RMM's reranker signal: shuffled display order, no copyable citation example, a full first stage, the evidence reward.

The bank the scripted reflection builds from the tiny LoCoMo fixture holds four memories:
m0 "Ana's cat Miso broke a vase" (D1:1, D2:1), m1 "Ben started learning the violin." (D1:2),
m2 "Ben moved to Lisbon." (D2:2), m3 "Ben's violin teacher is Rosa." (D3:1).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine
from test_rmm import reply

from lightning_memrl import GenerationSettings
from lightning_memrl.data.locomo import load_locomo
from lightning_memrl.workflows.rmm import (
    DEFAULT_ANSWER_TEMPLATE,
    RMMWorkflow,
    evidence_rewards,
    parse_citations,
    reinforce_loss,
    selection_log_probs,
)

SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=16)
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=16)
CONFIG = Path(__file__).resolve().parents[1] / "configs/rmm/locomo.yaml"


def cite_rosa(prompt: str) -> str:
    """Reflection as in test_rmm; the answer cites the displayed number of the memory about Rosa."""
    if "Question:" not in prompt:
        return reply(prompt)
    number = re.search(r"^\[(\d+)\][^\n]*Rosa", prompt, flags=re.MULTILINE)
    return f"Answer: \\boxed{{Rosa}}\nCitations: [{number.group(1) if number else ''}]"


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path))  # [0] "What is the name of Ana's cat?", [3] "Who teaches Ben?"


def _workflow(tiny_tokenizer, replier=cite_rosa, **kwargs):
    workflow = RMMWorkflow(**kwargs)
    workflow.frozen_engine = engine = ScriptedEngine(tiny_tokenizer, replier)
    return workflow, engine


def test_training_shuffles_the_display_and_maps_citations_back(tasks, tiny_tokenizer):
    workflow, engine = _workflow(tiny_tokenizer, top_k=4, top_m=4, gumbel=False)  # reranker order fixed
    positions = set()
    for seed in range(8):
        torch.manual_seed(seed)
        (trajectory,) = workflow.rollout(engine, [tasks[3]], SAMPLED)
        info = trajectory.info
        order, shown = info["shown_order"], info["shown_ids"]
        assert sorted(order) == [0, 1, 2, 3]
        displayed = re.findall(r"^\[(\d)\] ([^\n]*)", engine.calls[-1][0], flags=re.MULTILINE)
        bank = workflow._bank_cache["conv-test"]
        assert [n for n, _ in displayed] == ["1", "2", "3", "4"]
        assert all(text.endswith(bank.get(shown[i]).text) for (_, text), i in zip(displayed, order))
        assert [shown[i] for i in info["cited"]] == ["m3"]  # whatever number it had, the Rosa memory is rewarded
        assert info["citation_rewards"] == [1.0 if shown[i] == "m3" else -1.0 for i in range(4)]
        positions.add(order.index(shown.index("m3")) + 1)
        workflow.module_loss(None)
    assert len(positions) > 1  # m3 was displayed under different numbers
    (evaluated,) = workflow.rollout(engine, [tasks[3]], GREEDY)
    assert evaluated.info["shown_order"] == [0, 1, 2, 3]  # evaluation keeps the reranker's order
    unshuffled, engine = _workflow(tiny_tokenizer, top_k=4, top_m=4, gumbel=False, shuffle_shown=False)
    (trajectory,) = unshuffled.rollout(engine, [tasks[3]], SAMPLED)
    assert trajectory.info["shown_order"] == [0, 1, 2, 3]


def test_default_answer_template_has_no_citation_example_and_the_config_matches():
    assert re.search(r"Citations:\s*\[\s*\d", DEFAULT_ANSWER_TEMPLATE) is None
    assert "Citations: [numbers of the memories you used]" in DEFAULT_ANSWER_TEMPLATE
    assert parse_citations("Answer: \\boxed{Rosa}\nCitations: [numbers of the memories you used]", 4) == set()
    args = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["workflow"]["init_args"]
    assert "answer_template" not in args  # the config uses the default template
    assert (args["shuffle_shown"], args["min_retrieval_score"], args["reranker_reward"]) == (True, None, "citation")


def test_first_stage_fills_top_k_unless_min_retrieval_score(tasks, tiny_tokenizer):
    counts = {}
    for cut in (None, 0.0):
        workflow, engine = _workflow(tiny_tokenizer, top_k=4, top_m=4, min_retrieval_score=cut)
        trajectories = workflow.rollout(engine, [tasks[0], tasks[3]], SAMPLED)
        counts[cut] = [len(t.info["shown_ids"]) for t in trajectories]
        assert workflow.step_metrics(None)["reranker/shown_mean"] == sum(counts[cut]) / 2
    assert counts[None] == [4, 4]  # the whole bank of 4
    assert counts[0.0] == [1, 3]  # BM25 > 0: only m0 shares a term with the cat question, m1-m3 "Ben"


def test_evidence_reward_scores_shown_memories_by_their_source_turns(tasks, tiny_tokenizer):
    assert evidence_rewards([["D1:1", "D2:1"], ["D1:2"], []], ["D2:1"]).tolist() == [1.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="reranker_reward"):
        RMMWorkflow(reranker_reward="evidence-recall")
    no_citations = lambda p: reply(p) if "Question:" not in p else "Answer: \\boxed{Rosa}"  # noqa: E731
    workflow, engine = _workflow(tiny_tokenizer, no_citations, top_k=4, top_m=2, reranker_reward="evidence")
    torch.manual_seed(0)
    trajectories = workflow.rollout(engine, [tasks[3]] * 8, SAMPLED)  # one group of 8, evidence D3:1, D1:2
    expected_means = []
    for t in trajectories:
        want = [1.0 if i in ("m1", "m3") else -1.0 for i in t.info["shown_ids"]]
        assert t.info["evidence_rewards"] == want and t.info["citation_rewards"] == [-1.0, -1.0]
        expected_means.append(sum(want) / 2)
    metrics, loss = workflow.step_metrics(None), workflow.module_loss(None)
    assert metrics["reranker/reward"] == pytest.approx(sum(expected_means) / 8)
    assert metrics["reranker/citation_reward"] == -1.0 and metrics["reranker/no_evidence"] == 0.0
    assert len(set(expected_means)) > 1 and metrics["reranker/reward_varied_groups"] == 1.0
    assert loss.requires_grad


def test_evidence_reward_moves_the_reranker_towards_evidence(tasks, tiny_tokenizer):
    workflow, engine = _workflow(tiny_tokenizer, top_k=4, top_m=2, reranker_reward="evidence", temperature=1.0)
    optimizer = torch.optim.SGD(workflow.reranker.parameters(), lr=0.05)

    def evidence_mass() -> float:
        bank = workflow._bank_cache["conv-test"]
        entries = [e for e, _ in bank.retrieve(tasks[3].question, 4, None)]
        query = workflow.embedder.embed([tasks[3].question])[0]
        with torch.no_grad():
            probs = torch.softmax(workflow.reranker(query, workflow.embedder.embed([e.text for e in entries])), -1)
        return sum(float(p) for p, e in zip(probs, entries) if e.id in ("m1", "m3"))

    torch.manual_seed(0)
    workflow.rollout(engine, [tasks[3]] * 4, SAMPLED)
    before = evidence_mass()
    for _ in range(15):
        optimizer.zero_grad()
        workflow.module_loss(None).backward()
        optimizer.step()
        workflow.rollout(engine, [tasks[3]] * 4, SAMPLED)
    assert evidence_mass() > before + 0.1


def test_reinforce_under_evidence_rewards_matches_the_hand_formula(tasks, tiny_tokenizer):
    workflow, engine = _workflow(tiny_tokenizer, top_k=4, top_m=2, reranker_reward="evidence")
    torch.manual_seed(1)
    (trajectory,) = workflow.rollout(engine, [tasks[3]], SAMPLED)
    scores, chosen = _last_selection(workflow, trajectory)
    rewards = torch.tensor(trajectory.info["evidence_rewards"])
    expected = reinforce_loss(selection_log_probs(scores, chosen, workflow.temperature), rewards, 0.0)
    torch.testing.assert_close(workflow.module_loss(None).detach(), expected)


def _last_selection(workflow: RMMWorkflow, trajectory) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute the selection's scores (the reranker did not move) and the chosen indices."""
    bank = workflow._bank_cache["conv-test"]
    candidates = [e for e, _ in bank.retrieve(trajectory.task.question, workflow.top_k, workflow.min_retrieval_score)]
    query = workflow.embedder.embed([trajectory.task.question])[0]
    scores = workflow.reranker(query, workflow.embedder.embed([e.text for e in candidates]))
    chosen = torch.tensor([[e.id for e in candidates].index(i) for i in trajectory.info["shown_ids"]])
    return scores, chosen
