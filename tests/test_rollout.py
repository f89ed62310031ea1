"""The rollout engine: batched generation, exact log-probs, EOS/stop handling, truncation."""

from __future__ import annotations

import torch

from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.settings import GenerationSettings


def _prompts(tokenizer):
    texts = ["The secret code of Alice is 1234.", "Question: what is the code?", "A train from the north"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _forward_logprobs(model, prompt, generated, temperature):
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logp[positions, torch.tensor(generated)]


def test_logprobs_match_separate_forward_pass(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer)
    assert len({len(p) for p in prompts}) > 1  # different lengths: left padding is exercised
    torch.manual_seed(0)
    settings = GenerationSettings(temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=12)
    generations = engine.generate(prompts, settings)
    assert len(generations) == len(prompts)
    for prompt, gen in zip(prompts, generations):
        assert len(gen.token_ids) == gen.logprobs.shape[0] >= 1
        expected = _forward_logprobs(tiny_model, prompt, gen.token_ids, 0.8)
        torch.testing.assert_close(gen.logprobs, expected, atol=1e-4, rtol=0)


def test_greedy_is_deterministic_and_truncation_flag(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=6)
    first = engine.generate(prompts, settings)
    second = engine.generate(prompts, settings)
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    for prompt, gen in zip(prompts, first):
        ended = gen.token_ids[-1] == tiny_tokenizer.eos_token_id
        assert gen.truncated == (not ended)
        assert len(gen.token_ids) <= 6
        torch.testing.assert_close(
            gen.logprobs, _forward_logprobs(tiny_model, prompt, gen.token_ids, 1.0), atol=1e-4, rtol=0
        )


def test_eos_ends_a_response(tiny_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    with torch.no_grad():  # make EOS the most likely token everywhere
        tiny_model.lm_head.weight[eos] += 50.0
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    gens = engine.generate(_prompts(tiny_tokenizer), GenerationSettings(temperature=0.0, max_new_tokens=8))
    assert all(g.token_ids == [eos] and not g.truncated for g in gens)


def test_stop_string_cuts_response(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    prompts = _prompts(tiny_tokenizer)[:1]
    free = engine.generate(prompts, GenerationSettings(temperature=0.0, max_new_tokens=10))[0]
    assert len(free.token_ids) >= 3
    # stop on the text of the 2nd generated token: generation must end right there
    stop = tiny_tokenizer.decode(free.token_ids[1:2])
    assert stop.strip(), "pick a visible token"
    cut = engine.generate(prompts, GenerationSettings(temperature=0.0, max_new_tokens=10, stop_strings=[stop]))[0]
    assert not cut.truncated
    assert stop in tiny_tokenizer.decode(cut.token_ids)
    assert stop not in tiny_tokenizer.decode(cut.token_ids[:-1])
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]


def test_logprobs_recorded_while_sampling_equal_generates_own_logits(tiny_model, tiny_tokenizer):
    """Streamed log-probs (one step's logits held at a time) are exactly those of ``output_logits=True``."""
    from lightning_memrl.logprobs import selected_logprobs
    from lightning_memrl.rollout.prefix import left_pad

    engine = RolloutEngine(tiny_model, tiny_tokenizer, share_prefixes=False, pack_weights=False)
    prompts = _prompts(tiny_tokenizer)
    settings = GenerationSettings(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=10)
    kept: list = []
    original = tiny_model.generate

    def generate(**kwargs):  # the engine's own call, with generate's logits asked for as well
        out = original(**{**kwargs, "output_logits": True})
        kept.append(out)
        return out

    tiny_model.generate = generate
    try:
        torch.manual_seed(3)
        gens = engine.generate(prompts, settings)
    finally:
        del tiny_model.generate
    (out,) = kept
    ids, _ = left_pad(prompts, engine.pad_id, torch.device("cpu"))
    new_ids = out.sequences[:, ids.shape[1] :]
    assert len(out.logits) == new_ids.shape[1] >= 2
    expected = torch.stack([selected_logprobs(lg, new_ids[:, s], 0.7) for s, lg in enumerate(out.logits)], dim=1)
    for row, gen in enumerate(gens):
        n = len(gen.token_ids)
        assert gen.token_ids == new_ids[row, :n].tolist()
        assert torch.equal(gen.logprobs, expected[row, :n])  # bit for bit
    assert engine._generate_kwargs(settings, 10)["output_logits"] is False  # the engine keeps no [S, B, V] logits
