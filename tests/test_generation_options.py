"""TRL's sampling options: min_p, repetition_penalty, generation_kwargs and num_generations_eval.

They change which tokens are sampled; the recorded log-probs stay the model's own tempered
distribution (what the update computes), so ``train/logprob_gap`` stays about 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import AnswerLength
from lightning.pytorch.cli import LightningCLI

from lightning_memrl import (
    ConfigError,
    GenerationSettings,
    MemAgentWorkflow,
    MemRLDataModule,
    MemRLModule,
    SyntheticTaskSettings,
)
from lightning_memrl.errors import find_user_error
from lightning_memrl.models import build_tiny_model
from lightning_memrl.rollout.hf import RolloutEngine

TEXTS = ["The secret code of Alice is 1234. Bob", "Question: what is the code of Bob? Section:", "Alice Bob Alice"]


@pytest.fixture(scope="module")
def sharp_model(tiny_tokenizer):
    """The tiny model with logits 5x larger: random weights otherwise give an almost flat distribution."""
    model = build_tiny_model(tiny_tokenizer, seed=0).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(5.0)
    return model


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _forward_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """[S, V] log softmax(logits / T) of the model at each generated position (one row, no padding)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _generate(model, tokenizer, **settings):
    engine = RolloutEngine(model, tokenizer, share_prefixes=False)
    prompts = _prompts(tokenizer)
    torch.manual_seed(0)
    generations = [engine.generate([p], GenerationSettings(max_new_tokens=12, **settings))[0] for p in prompts]
    return prompts, generations


def test_min_p_keeps_only_tokens_near_the_top_and_logprobs_stay_the_models(sharp_model, tiny_tokenizer):
    def below_min_p(min_p):
        prompts, gens = _generate(sharp_model, tiny_tokenizer, temperature=1.0, min_p=min_p)
        below = 0
        for prompt, gen in zip(prompts, gens):
            full = _forward_logprobs(sharp_model, prompt, gen.token_ids, 1.0)  # [S, V]
            picked = full.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
            # recorded = the model's tempered log-prob, not the min-p-truncated one: logprob_gap ~ 0
            torch.testing.assert_close(gen.logprobs, picked, atol=1e-4, rtol=0)
            below += int((picked < full.max(-1).values + torch.log(torch.tensor(0.3))).sum())
        return below

    assert below_min_p(None) > 0  # without min_p, tokens under 0.3 x the top probability are sampled
    assert below_min_p(0.3) == 0


def _repeats(prompts, gens) -> int:
    """Generated tokens already in the prompt or earlier in the response."""
    return sum(
        tok in prompt + gen.token_ids[:i] for prompt, gen in zip(prompts, gens) for i, tok in enumerate(gen.token_ids)
    )


def test_repetition_penalty_avoids_context_tokens_also_greedy_and_records_the_models_logprobs(
    sharp_model, tiny_tokenizer
):
    prompts, plain = _generate(sharp_model, tiny_tokenizer, temperature=0.0)
    _, penalised = _generate(sharp_model, tiny_tokenizer, temperature=0.0, repetition_penalty=50.0)
    assert _repeats(prompts, plain) > 2 * _repeats(prompts, penalised)
    for prompt, gen in zip(prompts, penalised):  # greedy: log-probs at temperature 1, of the model
        picked = _forward_logprobs(sharp_model, prompt, gen.token_ids, 1.0).gather(
            1, torch.tensor(gen.token_ids)[:, None]
        )
        torch.testing.assert_close(gen.logprobs, picked[:, 0], atol=1e-4, rtol=0)
    # validation and frozen agents (greedy) keep the penalty
    assert GenerationSettings(repetition_penalty=1.3).greedy().repetition_penalty == 1.3


def test_generation_kwargs_reach_generate(sharp_model, tiny_tokenizer):
    def repeated_bigrams(**settings):
        prompts, gens = _generate(sharp_model, tiny_tokenizer, temperature=0.0, **settings)
        count = 0
        for prompt, gen in zip(prompts, gens):
            seq = prompt + gen.token_ids
            seen = {tuple(seq[i : i + 2]) for i in range(len(prompt) - 1)}
            for i in range(len(prompt) - 1, len(seq) - 1):
                count += tuple(seq[i : i + 2]) in seen
                seen.add(tuple(seq[i : i + 2]))
        return count

    assert repeated_bigrams() > 0
    assert repeated_bigrams(generation_kwargs={"no_repeat_ngram_size": 2}) == 0


def test_sampling_only_kwargs_are_left_out_of_greedy_turns(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer)
    settings = GenerationSettings(temperature=1.0, generation_kwargs={"typical_p": 0.5, "no_repeat_ngram_size": 3})
    sampled = engine._generate_kwargs(settings, 8)
    assert sampled["typical_p"] == 0.5 and sampled["no_repeat_ngram_size"] == 3
    greedy = engine._generate_kwargs(settings.greedy(), 8)
    assert greedy["typical_p"] is None and greedy["no_repeat_ngram_size"] == 3  # None: neutral, as before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 0.5}, "generation_kwargs.temperature is set by model.init_args.generation.temperature"),
        ({"num_return_sequences": 4}, "is set by model.init_args.grpo.group_size"),
        ({"max_length": 9}, "generation_kwargs.max_length is set by model.init_args.generation.max_new_tokens"),
        ({"output_logits": False}, "is set by the rollout engine"),
        ({"no_repeat_ngram": 2}, "generation_kwargs.no_repeat_ngram is not an option of transformers' generate"),
    ],
)
def test_generation_kwargs_that_clash_or_are_unknown_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GenerationSettings(generation_kwargs=kwargs)


def test_option_ranges():
    with pytest.raises(ConfigError, match=r"generation.min_p must be in \[0.0, 1.0\]"):
        GenerationSettings(min_p=1.5)
    with pytest.raises(ConfigError, match="generation.repetition_penalty must be > 0.0"):
        GenerationSettings(repetition_penalty=0.0)
    with pytest.raises(ConfigError, match="num_generations_eval=4 samples several .*temperature is 0"):
        GenerationSettings(temperature=0.0, num_generations_eval=4)


def _validate(tmp_path, n: int) -> tuple[dict, list[dict], dict]:
    module = MemRLModule(
        workflow=MemAgentWorkflow(max_memory_tokens=8),
        rewards=[AnswerLength()],
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8, num_generations_eval=n),
    )
    data = MemRLDataModule(
        batch_size=2,
        val_batch_size=4,
        synthetic=SyntheticTaskSettings(num_tasks=4, sentences_per_chunk=1),
        synthetic_val=SyntheticTaskSettings(num_tasks=3, seed=99, sentences_per_chunk=1),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    (metrics,) = trainer.validate(module, data)
    rows = [json.loads(line) for line in (tmp_path / "eval_predictions_step0.jsonl").open()]
    report = json.loads((tmp_path / "eval_report_step0.json").read_text())
    return metrics, rows, report


def test_num_generations_eval_samples_that_many_responses_per_validation_task(tmp_path):
    _, greedy_rows, greedy_report = _validate(tmp_path / "one", 1)
    metrics, rows, report = _validate(tmp_path / "three", 3)
    ids = [row["id"] for row in greedy_rows]
    assert len(ids) == 3 and "samples_per_task" not in greedy_report
    assert [row["id"] for row in rows] == [i for i in ids for _ in range(3)]  # three sampled answers per task
    assert len({row["completion"] for row in rows}) > len(ids)  # sampled: the answers of a task differ
    assert report["samples_per_task"] == 3 and report["overall"]["tasks"] == 9
    mean_em = sum(row["exact_match"] for row in rows) / len(rows)
    assert metrics["val/exact_match"] == pytest.approx(mean_em)


def test_options_parse_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "memagent" / "tiny.yaml")

    def parse(*options):
        args = ["--config", tiny, "--trainer.logger=false", *options]
        return LightningCLI(
            MemRLModule,
            MemRLDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=args,
            save_config_callback=None,
        )

    g = "--model.init_args.generation."
    cli = parse(
        g + "min_p=0.1",
        g + "repetition_penalty=1.2",
        g + "generation_kwargs={no_repeat_ngram_size: 3}",
        g + "num_generations_eval=2",
        "--model.init_args.lora={r: 4, alpha: 8, use_rslora: true}",
    )
    generation = cli.model.generation
    assert (generation.min_p, generation.repetition_penalty, generation.num_generations_eval) == (0.1, 1.2, 2)
    assert generation.generation_kwargs == {"no_repeat_ngram_size": 3}
    assert (cli.model.lora.lora_alpha, cli.model.lora.use_rslora) == (8, True)
    with pytest.raises(Exception) as err:  # what the lightning-memrl command prints alone
        parse(g + "generation_kwargs={temperature: 0.5}")
    assert "generation_kwargs.temperature is set by model.init_args.generation.temperature" in str(
        find_user_error(err.value)
    )
