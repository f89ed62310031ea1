"""RMM: the reranker, its REINFORCE update, citation rewards, reflection, and training through MemRLModule."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import quiet_trainer
from locomo_fixture import write_locomo
from scripted_engine import ScriptedEngine

from lightning_memrl import GenerationSettings, GRPOSettings, MemRLDataModule, MemRLModule
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.types import ANSWER_TURN
from lightning_memrl.workflows.bank import conversation_of
from lightning_memrl.workflows.rmm import (
    Reranker,
    RMMWorkflow,
    citation_rewards,
    gumbel_top_m,
    parse_citations,
    reinforce_loss,
    selection_log_probs,
)
from lightning_memrl.workflows.rmm_reranker import SourceTurnScorer, source_turn_scores, standardised

SAMPLED = GenerationSettings(temperature=1.0, max_new_tokens=16)
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=16)


def reply(prompt: str) -> str:
    if "List at most" in prompt:
        if "session_1 (" in prompt:
            return "[D1:1] Ana adopted a cat named Miso.\n[D1:2] Ben started learning the violin."
        if "session_2 (" in prompt:
            return "[D2:1] Miso the cat broke a vase.\n[D2:2] Ben moved to Lisbon."
        return "[D3:1] Ben's violin teacher is Rosa."
    if "Existing memories similar" in prompt:
        new = prompt.split("New memory", 1)[1]
        if "vase" in new:
            return '{"op": "MERGE", "id": "m0", "text": "Ana\'s cat Miso broke a vase"}'
        if "Lisbon" in new:
            return '{"op": "ADD"}'
        return "hmm"  # unusable: the topic is added
    return "Answer: \\boxed{Rosa} [1]\nCitations: [1]"


def test_reranker_starts_as_dot_product_and_the_update_follows_the_citations():
    torch.manual_seed(0)
    reranker = Reranker(4)
    query, memories = torch.randn(4), torch.randn(3, 4)  # [D], [K, D]
    scores = reranker(query, memories)
    torch.testing.assert_close(scores, memories @ query)  # zero adapters: identity
    chosen = torch.tensor([0, 1])
    log_p = selection_log_probs(scores, chosen, temperature=0.5)  # [M]
    torch.testing.assert_close(log_p, torch.log_softmax(scores / 0.5, -1)[:2])
    rewards = citation_rewards({0}, 2)  # memory 0 cited, memory 1 not
    assert rewards.tolist() == [1.0, -1.0]
    loss = reinforce_loss(log_p, rewards, baseline=0.0)
    torch.testing.assert_close(loss, log_p[1] - log_p[0])  # -(+1 * lp0) - (-1 * lp1)
    optimizer = torch.optim.SGD(reranker.parameters(), lr=0.01)
    before = [p.detach().clone() for p in reranker.parameters()]
    p_before = torch.softmax(scores.detach() / 0.5, -1)
    loss.backward()
    optimizer.step()
    changed = {n for (n, p), b in zip(reranker.named_parameters(), before) if (p - b).abs().max() > 1e-6}
    # the memory bias shifts every score equally, so the softmax (and its gradient) ignores it
    assert changed == {"query_adapter.weight", "query_adapter.bias", "memory_adapter.weight"}
    p_after = torch.softmax(reranker(query, memories).detach() / 0.5, -1)
    assert p_after[0] / p_after[1] > p_before[0] / p_before[1]  # cited memory gains on the uncited one
    assert float(reinforce_loss(selection_log_probs(reranker(query, memories), chosen, 0.5), rewards, 0.0)) < float(
        loss
    )
    only_cited = reinforce_loss(selection_log_probs(reranker(query, memories), chosen[:1], 0.5), torch.ones(1), 0.0)
    optimizer.zero_grad()
    only_cited.backward()
    optimizer.step()
    assert torch.softmax(reranker(query, memories).detach() / 0.5, -1)[0] > p_after[0]  # a cited memory alone: up


def test_first_stage_feature_starts_as_identity_and_adds_the_weighted_standardised_score():
    torch.manual_seed(0)
    query, memories = torch.randn(4), torch.randn(3, 4)  # [D], [K, D]
    bm25 = torch.tensor([3.0, 1.0, 2.0])  # [K] first-stage scores
    reranker = Reranker(4, first_stage_feature=True)
    torch.testing.assert_close(reranker(query, memories, bm25), memories @ query)  # w = 0: the identity
    with torch.no_grad():
        reranker.first_stage_weight.fill_(0.5)
    z = torch.tensor([1.0, -1.0, 0.0]) * (1.5**0.5)  # (x - 2) / sqrt(2/3), by hand
    torch.testing.assert_close(reranker(query, memories, bm25), memories @ query + 0.5 * z)
    torch.testing.assert_close(standardised(torch.tensor([2.0, 2.0])), torch.zeros(2))  # equal scores: no signal
    with pytest.raises(ValueError, match="needs the candidates' first-stage scores"):
        reranker(query, memories)


def test_source_turn_feature_adds_the_weighted_standardised_best_turn_match():
    query = torch.tensor([1.0, 0.0])  # [D]
    turns = [torch.tensor([[0.2, 1.0], [0.9, 0.0]]), torch.tensor([[0.3, 0.3]]), torch.zeros(0, 2)]  # [T_k, D]
    best = source_turn_scores(query, turns)  # max_j v_kj . q, by hand: 0.9, 0.3, and 0 for no turn
    torch.testing.assert_close(best, torch.tensor([0.9, 0.3, 0.0]))
    memories = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # [K, D]: dot products 1, 0, 0.5
    reranker = Reranker(2, source_turn_feature=True)
    torch.testing.assert_close(reranker(query, memories, None, best), torch.tensor([1.0, 0.0, 0.5]))  # w = 0
    with torch.no_grad():
        reranker.source_turn_weight.fill_(2.0)
    mean, std = 0.4, (((0.5**2) + (0.1**2) + (0.4**2)) / 3) ** 0.5  # of 0.9, 0.3, 0.0
    z = torch.tensor([(0.9 - mean) / std, (0.3 - mean) / std, (0.0 - mean) / std])
    torch.testing.assert_close(reranker(query, memories, None, best), torch.tensor([1.0, 0.0, 0.5]) + 2.0 * z)
    with pytest.raises(ValueError, match="needs the candidates' source-turn scores"):
        reranker(query, memories)


class _CountingEmbedder:
    dim = 2

    def __init__(self) -> None:
        self.texts: list[str] = []

    def embed(self, texts: list[str]) -> torch.Tensor:
        self.texts += texts
        return torch.tensor([[float(len(t)), 1.0] for t in texts])  # [N, D]


def test_source_turn_scorer_embeds_each_turn_once_and_ignores_unknown_ids(tmp_path):
    (task, *_) = load_locomo(write_locomo(tmp_path), LoCoMoSettings())
    conversation, embedder = conversation_of(task), _CountingEmbedder()
    scorer, query = SourceTurnScorer(embedder), torch.tensor([0.0, 1.0])  # every turn scores 1.0
    torch.testing.assert_close(scorer(query, conversation, [["D1:1", "D9:9"], ["D9:9"]]), torch.tensor([1.0, 0.0]))
    scorer(torch.tensor([1.0, 0.0]), conversation, [["D1:1", "D1:2"]])
    by_id = {t.dia_id: t for s in conversation.sessions for t in s.turns}
    assert embedder.texts == [f"{by_id[i].speaker}: {by_id[i].text}" for i in ("D1:1", "D1:2")]  # D1:1 once


def test_feature_lr_scale_multiplies_the_weight_and_its_adam_step():
    query, memories = torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # dot products 1, 0
    turns = torch.tensor([0.0, 2.0])  # standardised: -1, +1
    steps = {}
    for scale in (1.0, 30.0):
        reranker = Reranker(2, source_turn_feature=True, feature_lr_scale=scale)
        with torch.no_grad():
            reranker.source_turn_weight.fill_(0.1)
        torch.testing.assert_close(reranker(query, memories, None, turns), torch.tensor([1 - 0.1 * scale, 0.1 * scale]))
        optimizer = torch.optim.Adam([reranker.source_turn_weight], lr=0.01)
        (-reranker(query, memories, None, turns)[1]).backward()  # descend: raise the second memory's score
        optimizer.step()
        steps[scale] = scale * float(reranker.source_turn_weight) - scale * 0.1  # change of the weight scores see
    # Adam's first step moves the parameter by lr whatever its gradient: the effective weight by scale x lr
    assert steps[1.0] == pytest.approx(0.01, rel=1e-3) and steps[30.0] == pytest.approx(0.3, rel=1e-3)
    with pytest.raises(ValueError, match="feature_lr_scale must be > 0"):
        RMMWorkflow(feature_lr_scale=0.0)


def test_the_first_stage_weight_rises_when_the_first_stage_order_is_rewarded():
    torch.manual_seed(0)
    reranker = Reranker(4, first_stage_feature=True)
    query, memories, bm25 = torch.randn(4), torch.randn(3, 4), torch.tensor([3.0, 1.0, 2.0])
    scores = reranker(query, memories, bm25)
    chosen = torch.tensor([0, 1])  # the first stage's best (0) was right, its worst (1) was not
    reinforce_loss(selection_log_probs(scores, chosen, 0.5), torch.tensor([1.0, -1.0]), 0.0).backward()
    assert float(reranker.first_stage_weight.grad) < 0  # descending the loss raises w


def test_reinforce_loss_sign():
    log_p = torch.log(torch.tensor([0.5, 0.25]))
    assert float(reinforce_loss(log_p, torch.tensor([1.0, 1.0]), 0.0)) == pytest.approx(-(-0.6931 - 1.3863), abs=1e-3)
    assert float(reinforce_loss(log_p, torch.tensor([-1.0, -1.0]), 0.0)) < 0  # uncited: push them down
    assert float(reinforce_loss(log_p, torch.tensor([1.0, -1.0]), 1.0)) == pytest.approx(2 * -1.3863, abs=1e-3)


def test_citation_parsing_and_rewards():
    assert parse_citations("Answer: \\boxed{Miso}\nCitations: [1, 3]", 3) == {0, 2}
    assert parse_citations("It is Miso [2][9]", 3) == {1}  # 9 was not shown
    assert parse_citations("Citations: none", 3) == set()
    assert citation_rewards({0, 2}, 3).tolist() == [1.0, -1.0, 1.0]
    assert citation_rewards(set(), 2).tolist() == [-1.0, -1.0]


def test_gumbel_top_m():
    scores = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert gumbel_top_m(scores, 2, 1.0, noise=False).tolist() == [0, 2]
    assert gumbel_top_m(scores, 9, 1.0, noise=False).numel() == 4
    draws = {
        tuple(sorted(gumbel_top_m(scores, 2, 1.0, generator=torch.Generator().manual_seed(s)).tolist()))
        for s in range(30)
    }
    assert len(draws) > 1 and all(len(set(d)) == 2 for d in draws)  # noise explores, never repeats an index


@pytest.fixture()
def tasks(tmp_path):
    return load_locomo(write_locomo(tmp_path))


def test_prospective_reflection_adds_and_merges(tasks, tiny_tokenizer):
    workflow = RMMWorkflow(merge_top_k=3)
    workflow.frozen_engine = engine = ScriptedEngine(tiny_tokenizer, reply)
    ((bank, _),) = workflow.build_banks(engine, [tasks[0].meta["conversation"]], GREEDY, False)
    assert [(e.id, e.text, e.source_ids) for e in bank.entries] == [
        ("m0", "Ana's cat Miso broke a vase", ["D1:1", "D2:1"]),
        ("m1", "Ben started learning the violin.", ["D1:2"]),
        ("m2", "Ben moved to Lisbon.", ["D2:2"]),
        ("m3", "Ben's violin teacher is Rosa.", ["D3:1"]),
    ]
    assert (workflow.counters["ADD"], workflow.counters["MERGE"], workflow.counters["invalid"]) == (3, 1, 1)


def test_reflection_lines_that_copy_the_prompt_are_dropped_and_counted(tasks, tiny_tokenizer):
    template = "Dialogue:\n{dialogue}\nList at most {max_topics} topics, e.g. [D1:3] Zoe visited her aunt in Porto."

    def copying(prompt: str) -> str:
        if "List at most" in prompt and "session_1 (" in prompt:
            return "[D1:3] Zoe visited her aunt in Porto.\n[D1:1] Ana adopted a cat named Miso."
        return "none" if "List at most" in prompt else '{"op": "ADD"}'

    workflow = RMMWorkflow(reflect_template=template)
    workflow.frozen_engine = engine = ScriptedEngine(tiny_tokenizer, copying)
    ((bank, _),) = workflow.build_banks(engine, [tasks[0].meta["conversation"]], GREEDY, False)
    assert [e.text for e in bank.entries] == ["Ana adopted a cat named Miso."]
    assert workflow.counters["copied"] == 1


def test_retrospective_reflection_gives_a_reranker_loss(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = RMMWorkflow(top_k=5, top_m=2)
    workflow.frozen_engine = engine  # the frozen reflection, scripted like the generator
    (trajectory,) = workflow.rollout(engine, [tasks[3]], SAMPLED)  # "Who teaches Ben?"
    assert [(t.kind, t.trainable) for t in trajectory.turns] == [(ANSWER_TURN, True)]
    assert trajectory.final_text == "\\boxed{Rosa}"  # citations are not part of the answer
    assert len(trajectory.info["shown_ids"]) == 2
    cited = trajectory.info["shown_order"][0]  # "[1]" names the memory displayed first (the display is shuffled)
    assert trajectory.info["citation_rewards"] == [1.0 if i == cited else -1.0 for i in range(2)]
    shown_prompt = engine.calls[-1][0]
    assert "[1]" in shown_prompt and "[2]" in shown_prompt and "[3]" not in shown_prompt.split("Question")[0]
    loss, metrics = workflow.module_loss(None), workflow.step_metrics(None)
    assert loss.requires_grad and metrics["reranker/citation_reward"] == 0.0
    loss.backward()
    assert workflow.reranker.query_adapter.weight.grad.abs().sum() > 0
    assert workflow.module_loss(None) is None and workflow.step_metrics(None) == {}  # taken
    assert workflow.baseline == pytest.approx(0.0)  # 0.9 * 0 + 0.1 * mean reward 0
    metrics = workflow.evaluation_metrics(trajectory)
    assert metrics["evidence_recall_at_k"] == 1.0  # D3:1 and D1:2 are both among the 4 candidates
    assert metrics["citation_reward"] == 0.0
    with torch.no_grad():
        workflow.rollout(engine, [tasks[3]], GREEDY)
    assert workflow.module_loss(None) is None and workflow.step_metrics(None) == {}  # evaluation trains nothing


def test_with_a_large_first_stage_weight_the_workflow_keeps_the_first_stage_order(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = RMMWorkflow(top_k=5, top_m=2, first_stage_feature=True, embedding="hashing")
    workflow.frozen_engine = engine
    with torch.no_grad():
        workflow.reranker.first_stage_weight.fill_(1e3)  # the first stage's order dominates the dot product
        (trajectory,) = workflow.rollout(engine, [tasks[3]], GREEDY)  # "Who teaches Ben?"
    (bank,) = workflow._bank_cache.values()
    score = {e.id: s for e, s in bank.retrieve(tasks[3].question, 5, None)}  # the first stage's (BM25) scores
    best = sorted(score.values(), reverse=True)[:2]
    assert [score[i] for i in trajectory.info["shown_ids"]] == best  # kept in the first stage's order (ties aside)
    with torch.no_grad():
        workflow.reranker.first_stage_weight.zero_()  # back to the identity: the embeddings' order
        (plain,) = workflow.rollout(engine, [tasks[3]], GREEDY)
    assert [score[i] for i in plain.info["shown_ids"]] != best


def test_with_a_large_source_turn_weight_the_workflow_shows_the_best_matching_dialogue(tasks, tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, reply)
    workflow = RMMWorkflow(top_k=5, top_m=2, source_turn_feature=True, embedding="hashing")
    workflow.frozen_engine = engine
    with torch.no_grad():
        workflow.reranker.source_turn_weight.fill_(1e3)
        (trajectory,) = workflow.rollout(engine, [tasks[3]], GREEDY)  # "Who teaches Ben?"
    (bank,) = workflow._bank_cache.values()
    by_id = {t.dia_id: t for s in conversation_of(tasks[3]).sessions for t in s.turns}
    query = workflow.embedder.embed([tasks[3].question])[0]
    best_turn = {}  # by hand: each candidate's best source turn, embedded apart from the scorer
    for entry, _ in bank.retrieve(tasks[3].question, 5, None):
        texts = [f"{by_id[i].speaker}: {by_id[i].text}" for i in entry.source_ids if i in by_id]
        best_turn[entry.id] = float((workflow.embedder.embed(texts) @ query).max())
    assert [best_turn[i] for i in trajectory.info["shown_ids"]] == sorted(best_turn.values(), reverse=True)[:2]
    with torch.no_grad():
        workflow.reranker.source_turn_weight.fill_(-1e3)  # the weight's sign decides: now the worst matches
        (worst,) = workflow.rollout(engine, [tasks[3]], GREEDY)
    assert sorted(best_turn[i] for i in worst.info["shown_ids"]) == sorted(best_turn.values())[:2]


class _Scripted(L.Callback):
    def on_fit_start(self, trainer, module):
        module.engine = module.workflow.frozen_engine = ScriptedEngine(module.tokenizer, reply)


def test_reranker_trains_inside_memrl_module_and_is_checkpointed(tmp_path):
    path = write_locomo(tmp_path / "data")
    workflow = RMMWorkflow(top_k=5, top_m=2, reranker_lr=0.05)
    module = MemRLModule(workflow=workflow, generation=SAMPLED, grpo=GRPOSettings(group_size=2))
    data = MemRLDataModule(locomo_path=str(path), locomo=LoCoMoSettings(categories=[1, 4]), batch_size=2)
    assert "workflow_modules.reranker.query_adapter.weight" in module.state_dict()
    trainer = quiet_trainer(tmp_path, steps=2, callbacks=[_Scripted()])
    trainer.fit(module, data)
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 2 and groups[1]["lr"] == 0.05
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in workflow.reranker.parameters()}
    assert workflow.reranker.query_adapter.weight.abs().sum() > 0  # moved away from its zero start
    assert trainer.global_step == 2


def test_reflect_with_base_reflects_on_the_frozen_engine_and_answers_with_the_policy(tasks, tiny_tokenizer):
    workflow = RMMWorkflow(train_generator=False, reflect_with_base=True)
    assert workflow.needs_frozen_model() and not RMMWorkflow(train_generator=False).needs_frozen_model()
    base, generator = ScriptedEngine(tiny_tokenizer, reply), ScriptedEngine(tiny_tokenizer, reply)
    workflow.frozen_engine = base
    (trajectory,) = workflow.rollout(generator, tasks[:1], GREEDY)
    assert [prompt for prompt, _ in base.calls if "Question:" in prompt] == []  # the base only reflects
    assert sum("List at most" in prompt for prompt, _ in base.calls) == 3
    assert [("Question:" in prompt, "List at most" in prompt) for prompt, _ in generator.calls] == [(True, False)]
    assert "Rosa" in trajectory.turns[-1].text and not trajectory.turns[-1].trainable  # answered, not trained
