"""The decode-loop backend: ``model.generate``'s tokens and log-probs from a loop of its own.

Greedy tokens equal ``RolloutEngine.generate``'s (ragged prompts, shared prefixes, rows ending at
different steps, static and dynamic cache); sampled tokens' recorded log-probs equal the learner's;
finished rows leave the decode batch; unsupported settings fall back to ``generate``, logged; the
backend is chosen from YAML and follows every optimizer step.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import parsed_cli, quiet_trainer, sampler_and_learner_logprobs

from lightning_memrl import GenerationSettings, LoraSettings, MemRLModule
from lightning_memrl.errors import ConfigError
from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout.decode_loop import DecodeLoopEngine
from lightning_memrl.rollout.hf import RolloutEngine

REPO = Path(__file__).resolve().parents[1]
GREEDY = GenerationSettings(temperature=0.0, max_new_tokens=10, repetition_penalty=50.0)  # no token twice: varied rows
SAMPLED = GenerationSettings(temperature=0.7, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.3, max_new_tokens=8)
HEADER = "Problem: what is the secret code of Alice? Memory: nothing yet. Section: the code of"


@pytest.fixture(scope="module")
def sharp_model(tiny_tokenizer):
    """The tiny model with logits 5x larger (random weights give a flat distribution: near ties under argmax)."""
    model = build_tiny_model(tiny_tokenizer, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(5.0)
    return model


def _ragged(tokenizer) -> list[list[int]]:
    texts = ["Alice is 1234. Bob", "Question: what is the code of Bob? Section: Bob has 77", "Alice", "Bob Alice Bob"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _shared(tokenizer) -> tuple[list[list[int]], list[int]]:
    """Two groups of three prompts: a long shared header, then ragged tails."""
    tails = ["Alice", "Bob is 12", "the end of it all", "x", "Alice Bob Alice Bob", "7"]
    prompts = [tokenizer(f"{HEADER} {g} {t}", add_special_tokens=False)["input_ids"] for g in (0, 1) for t in tails[:3]]
    return prompts, [0, 0, 0, 1, 1, 1]


def _ending_at_different_steps(engines, prompts, settings) -> None:
    """Add EOS tokens that end rows 0, 1, 2 at different steps (the last row runs to the cap)."""
    gens = RolloutEngine(engines[0].model, engines[0].tokenizer, share_prefixes=False).generate(prompts, settings)
    steps = [1, 4, 7] * len(gens)
    chosen = {gens[row].token_ids[steps[row]] for row in range(len(gens) - 1)} - set(gens[-1].token_ids)
    for engine in engines:
        engine.eos_ids = engine.eos_ids | chosen


class _DecodeBatches:
    """Batch sizes of the decode forwards (one new token per row), seen at the input embedding."""

    def __init__(self, model) -> None:
        self.sizes: list[int] = []
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs) -> None:
        if inputs[0].shape[1] == 1:
            self.sizes.append(inputs[0].shape[0])


def _same(ours, theirs, atol: float = 1e-5) -> None:
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    assert [g.truncated for g in ours] == [g.truncated for g in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_tokens_equal_generate_with_ragged_prompts_shared_prefixes_and_early_ends(
    sharp_model, tiny_tokenizer, cache
):
    ragged = _ragged(tiny_tokenizer)
    shared, labels = _shared(tiny_tokenizer)
    for prompts, prefix_labels in ((ragged, None), (shared, labels)):
        reference = RolloutEngine(sharp_model, tiny_tokenizer)
        ours = DecodeLoopEngine(sharp_model, tiny_tokenizer, cache=cache)
        _ending_at_different_steps([reference, ours], prompts, GREEDY)
        expected = reference.generate(prompts, GREEDY, prefix_labels=prefix_labels)
        lengths = {len(g.token_ids) for g in expected}
        assert len(lengths) >= 3 and any(g.truncated for g in expected), lengths  # rows end at different steps
        _same(ours.generate(prompts, GREEDY, prefix_labels=prefix_labels), expected)
    plain = GenerationSettings(temperature=0.0, max_new_tokens=10)
    _same(ours.generate(shared, plain, prefix_labels=labels), reference.generate(shared, plain, prefix_labels=labels))


def test_finished_rows_leave_the_decode_batch(sharp_model, tiny_tokenizer):
    prompts = _ragged(tiny_tokenizer)
    dropping = DecodeLoopEngine(sharp_model, tiny_tokenizer)
    keeping = DecodeLoopEngine(sharp_model, tiny_tokenizer, drop_finished=False)
    _ending_at_different_steps([dropping, keeping], prompts, GREEDY)
    batches = _DecodeBatches(sharp_model)
    kept = keeping.generate(prompts, GREEDY)
    kept_sizes, batches.sizes = batches.sizes, []
    dropped = dropping.generate(prompts, GREEDY)
    batches.handle.remove()
    _same(dropped, kept)
    assert kept_sizes == [4] * 9  # 10 tokens: the prefill's, then 9 decode steps of every row
    assert batches.sizes[0] == 4 and batches.sizes[-1] == 1 and sorted(batches.sizes, reverse=True) == batches.sizes
    assert sum(batches.sizes) < sum(kept_sizes)
    lengths = sorted(len(g.token_ids) for g in dropped)  # a row decodes until its EOS, then leaves
    assert sum(batches.sizes) == sum(n - 1 for n in lengths)


def test_sampling_is_generates_and_recorded_logprobs_equal_the_learners():
    module = MemRLModule("tiny", rollout=partial(DecodeLoopEngine, drop_finished=False, cache="dynamic"))
    module.configure_model()
    policy = module.policy.eval()
    with torch.no_grad():
        policy.model.norm.weight.mul_(3.0)
    prompts = _ragged(module.tokenizer)
    torch.manual_seed(3)  # every row decodes every step, as in generate: the same random draws
    ours = module.engine.generate(prompts, SAMPLED)
    torch.manual_seed(3)
    _same(ours, RolloutEngine(policy, module.tokenizer).generate(prompts, SAMPLED))
    _, gap = sampler_and_learner_logprobs(module, policy, prompts, ours)
    assert gap < 1e-4, f"recorded vs learner log-probs: {gap:.3g}"
    shared, labels = _shared(module.tokenizer)
    static = DecodeLoopEngine(policy, module.tokenizer)  # static cache, finished rows dropped
    torch.manual_seed(0)
    gens = static.generate(shared, SAMPLED, prefix_labels=labels)
    _, gap = sampler_and_learner_logprobs(module, policy, shared, gens)
    assert gap < 1e-4, f"static cache, shared prefixes: {gap:.3g}"


def test_unsupported_settings_fall_back_to_generate_counted_and_logged_once(sharp_model, tiny_tokenizer, caplog):
    prompts = _ragged(tiny_tokenizer)
    engine = DecodeLoopEngine(sharp_model, tiny_tokenizer)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=8, generation_kwargs={"no_repeat_ngram_size": 2})
    with caplog.at_level(logging.WARNING, logger="lightning_memrl.rollout.decode_loop"):
        ours = [engine.generate(prompts, settings) for _ in range(2)]
        engine.generate(prompts, GenerationSettings(temperature=0.0, max_new_tokens=4, stop_strings=["Bob"]))
    _same(ours[0], RolloutEngine(sharp_model, tiny_tokenizer).generate(prompts, settings))
    assert engine.fallbacks == {"generation_kwargs": 2, "stop_strings": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "generation_kwargs (no_repeat_ngram_size)" in messages[0]
    assert engine.unsupported(GREEDY) is None
    assert engine.unsupported(GenerationSettings(temperature=0.0, generation_kwargs={"typical_p": 0.5})) is None


def test_bad_options_stop_naming_the_option(tiny_model, tiny_tokenizer):
    with pytest.raises(ConfigError, match="rollout.init_args.cache must be 'static' or 'dynamic'"):
        DecodeLoopEngine(tiny_model, tiny_tokenizer, cache="paged")


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_next_rollout_samples_the_weights_of_the_last_optimizer_step(lora):
    module = MemRLModule("tiny", lora=lora, rollout=DecodeLoopEngine, generation=SAMPLED)
    module.configure_model()
    policy = module.policy.eval()
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=0.05)
    prompts = _ragged(module.tokenizer)
    probe = torch.tensor([prompts[1]])
    for _ in range(2):
        with torch.no_grad():
            before = policy(input_ids=probe).logits
        torch.stack([p.sum() for p in trained]).sum().neg().backward()  # every weight (LoRA's B too) moves
        opt.step()
        opt.zero_grad()
        module.engine.sync_weights(policy)
        with torch.no_grad():
            assert float((policy(input_ids=probe).logits - before).abs().max()) > 1e-3  # the step moved the model
        torch.manual_seed(0)
        _, gap = sampler_and_learner_logprobs(module, policy, prompts, module.engine.generate(prompts, SAMPLED))
        assert gap < 1e-4, f"rollout after a step vs learner: {gap:.3g}"
    if lora:
        assert module.engine.merged.merged_mib > 0  # sampled from merged weights, rebuilt after each step


def test_chosen_from_yaml_and_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overlay = REPO / "examples" / "decode_loop.yaml"
    cli = parsed_cli(
        ["--config", str(REPO / "configs/memagent/tiny.yaml"), "--config", str(overlay), "--trainer.logger=false"]
    )
    module = cli.model
    module.configure_model()
    engine = module.engine
    assert type(engine) is DecodeLoopEngine and engine.model is module.policy
    assert (engine.cache, engine.drop_finished) == ("static", True)
    quiet_trainer(tmp_path, steps=2).fit(module, cli.datamodule)
    assert module.global_step == 2 and engine.fallbacks == {}
    assert 0 <= float(module.trainer.callback_metrics["train/logprob_gap"]) < 1e-3
