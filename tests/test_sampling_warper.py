"""CandidateWarper: generate's temperature, top-k, top-p and min-p on each row's most likely tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.sampling import CandidateWarper, TokenDraw, draw_tokens
from lightning_memrl.settings import GenerationSettings


def _generates(temperature: float, top_k: int, top_p: float, min_p: float) -> LogitsProcessorList:
    """generate's own warpers, in generate's order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    return warpers


def test_nucleus_by_hand_growing_past_the_first_candidates() -> None:
    probs = torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.03, 0.01]])
    warper = CandidateWarper(1.0, top_p=0.8, candidates=2)  # 2 candidates hold 0.75 < 0.8: look further
    out = warper(None, probs.log())
    # mass of the more likely tokens: 0, 0.5, 0.75, 0.9, ...; kept while below 0.8: the first three
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False, False]]
    assert torch.allclose(out[0, :3], probs.log()[0, :3])
    assert torch.equal(torch.isfinite(_generates(1.0, 0, 0.8, 0.0)(None, probs.log())), torch.isfinite(out))


def test_min_p_and_top_k_by_hand() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    out = CandidateWarper(0.5, top_k=3, min_p=math.exp(-3.5), candidates=2)(None, logits)
    # T=0.5: scores 4, 2, 0, -2, -6; top-3 keeps 4, 2, 0; min-p keeps s - 4 >= -3.5: 4 and 2
    assert out.tolist()[0][:2] == [4.0, 2.0] and torch.isinf(out[0, 2:]).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 0.95, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 20, 0.95, 0.0), (0.7, 0, 0.95, 0.1), (1.3, 0, 0.999, 0.0)],
)
@pytest.mark.parametrize("sharpness", [1.0, 4.0])
def test_keeps_exactly_what_generates_warpers_keep(temperature, top_k, top_p, min_p, sharpness) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 500, generator=gen) * sharpness  # flat rows (the nucleus past the candidates) and peaked
    ours = CandidateWarper(temperature, top_k, top_p, min_p, candidates=16)(None, logits.clone())
    theirs = _generates(temperature, top_k, top_p, min_p)(None, logits.clone())
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_a_tied_top_k_boundary_goes_to_generates_warpers() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0, 0.0]])  # the 3rd and 4th tie: generate keeps both
    warper = CandidateWarper(1.0, top_k=3, top_p=0.99)
    out = warper(None, logits)
    assert warper.fallbacks == 1
    assert torch.equal(out, _generates(1.0, 3, 0.99, 0.0)(None, logits))
    assert torch.isfinite(out).sum() == 4


def test_engine_samples_the_tokens_generates_own_warpers_sample(tiny_tokenizer) -> None:
    model = build_tiny_model(tiny_tokenizer, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # peaked next-token distributions, as a trained model's
    settings = GenerationSettings(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12)
    engine = RolloutEngine(model, tiny_tokenizer, share_prefixes=False)
    kwargs = engine._generate_kwargs(settings, 12)
    assert kwargs["do_sample"] is False and (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (None,) * 3
    assert [type(p) for p in kwargs["logits_processor"]] == [CandidateWarper, TokenDraw]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    torch.manual_seed(11)
    ours = engine.generate(prompts, settings)
    ids = torch.tensor(prompts)
    torch.manual_seed(11)
    out = model.generate(  # generate's own warpers, then the same draw
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        logits_processor=LogitsProcessorList([*_generates(0.7, 0, 0.9, 0.0), TokenDraw()]),
        max_new_tokens=12,
        pad_token_id=engine.pad_id,
        eos_token_id=sorted(engine.eos_ids),
    )
    for row, gen in enumerate(ours):
        assert gen.token_ids == out[row, 4 : 4 + len(gen.token_ids)].tolist()


def test_generate_draws_itself_after_the_warpers_only_it_has(tiny_tokenizer) -> None:
    settings = GenerationSettings(temperature=0.7, top_p=0.9, generation_kwargs={"typical_p": 0.5})
    engine = RolloutEngine(build_tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer)
    kwargs = engine._generate_kwargs(settings, 4)
    assert kwargs["do_sample"] is True and kwargs["typical_p"] == 0.5
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (1.0, 1.0, 0)
    assert [type(p) for p in kwargs["logits_processor"]] == [CandidateWarper]


def test_draw_tokens_follows_the_probabilities_and_never_draws_a_removed_token() -> None:
    scores = torch.tensor([[0.0, math.log(3.0), -math.inf, math.log(6.0)], [-math.inf, -math.inf, 0.0, -math.inf]])
    torch.manual_seed(0)
    draws = torch.stack([draw_tokens(scores) for _ in range(20000)])  # [N, 2]
    first = torch.bincount(draws[:, 0], minlength=4).double() / len(draws)
    assert torch.allclose(first, torch.tensor([0.1, 0.3, 0.0, 0.6], dtype=torch.float64), atol=0.012)
    assert (draws[:, 1] == 2).all()
    torch.manual_seed(0)
    again = torch.stack([draw_tokens(scores) for _ in range(20000)])
    assert torch.equal(draws, again)  # repeatable under a seed


def test_draw_tokens_inverts_the_cumulative_sum_at_its_edges(monkeypatch) -> None:
    scores = torch.tensor([[-math.inf, 0.0, 0.0, -math.inf, 0.0, -math.inf]])  # thirds on tokens 1, 2, 4
    for uniform, token in ((0.0, 1), (0.33, 1), (0.34, 2), (0.66, 2), (0.67, 4), (1.0 - 2**-53, 4), (1.0, 4)):
        monkeypatch.setattr(torch, "rand", lambda *shape, u=uniform, **kw: torch.full(shape, u, dtype=torch.float64))
        assert draw_tokens(scores).tolist() == [token], uniform


def test_token_draw_leaves_generate_one_choice() -> None:
    scores = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    out = TokenDraw()(None, scores)
    torch.manual_seed(3)
    expected = draw_tokens(scores)
    assert torch.equal(out.argmax(-1), expected)
    assert (torch.isfinite(out).sum(-1) == 1).all() and torch.equal(out.max(-1).values, torch.zeros(3))


def test_a_users_logits_processor_runs_after_the_warper(tiny_tokenizer) -> None:
    class Mine:
        def __call__(self, input_ids, scores):
            return scores

    mine = Mine()
    settings = GenerationSettings(temperature=0.7, top_p=0.9, generation_kwargs={"logits_processor": [mine]})
    engine = RolloutEngine(build_tiny_model(tiny_tokenizer, seed=0), tiny_tokenizer)
    processors = engine._generate_kwargs(settings, 4)["logits_processor"]
    assert [type(p) for p in processors] == [CandidateWarper, Mine, TokenDraw] and processors[1] is mine
