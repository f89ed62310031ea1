"""The update scores tokens under the distribution the rollout sampled them from.

Models whose logits are post-processed (soft-capping, logit scales) and models whose
``generation_config`` ships distribution-changing options must give the same log-probs in the
rollout engine and in ``MemRLModule.sequence_logprobs``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sampler_and_learner_logprobs, scored_rollouts

from lightning_memrl import GenerationSettings, MemRLModule, losses
from lightning_memrl.rollout.hf import RolloutEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]


def _family(name: str, vocab: int, tokenizer) -> torch.nn.Module:
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    if name == "gemma2":
        config = Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0, attn_implementation="eager")
        model = Gemma2ForCausalLM(config)
    elif name == "cohere":
        model = CohereForCausalLM(CohereConfig(**common, logit_scale=0.25))
    else:
        model = GraniteForCausalLM(GraniteConfig(**common, logits_scaling=0.125))
    with torch.no_grad():  # spread logits so the post-processing matters
        model.get_output_embeddings().weight.normal_(0, 1.0)
    return model.eval()


def _rollout_and_update(module: MemRLModule, policy, settings: GenerationSettings):
    module.policy = policy
    module.engine = RolloutEngine(policy, module.tokenizer, share_prefixes=False)
    module.generation = settings
    torch.manual_seed(0)
    gens = module.engine.generate(PROMPTS, settings)
    update, gap = sampler_and_learner_logprobs(module, policy, PROMPTS, gens)
    return gens, gap


@pytest.fixture(scope="module")
def module() -> MemRLModule:
    module = MemRLModule("tiny", share_prefixes=False)
    module.configure_model()
    return module


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_rollout_and_update_logprobs_agree_on_post_processed_logits(module, family):
    policy = _family(family, len(module.tokenizer), module.tokenizer)
    _, gap = _rollout_and_update(module, policy, GenerationSettings(temperature=0.7, max_new_tokens=8))
    assert gap < 1e-4, f"{family}: rollout/update log-prob gap {gap:.3g}"


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_model_generation_config_does_not_change_the_sampled_distribution(module, temperature):
    from lightning_memrl.models import build_tiny_model

    policy = build_tiny_model(module.tokenizer, seed=0).eval()
    shipped = policy.generation_config
    shipped.repetition_penalty, shipped.no_repeat_ngram_size = 5.0, 2
    shipped.min_new_tokens, shipped.suppress_tokens, shipped.typical_p = 12, [7, 8, 9], 0.5
    settings = GenerationSettings(temperature=temperature, max_new_tokens=12)
    gens, gap = _rollout_and_update(module, policy, settings)
    assert gap < 1e-4, f"rollout/update log-prob gap {gap:.3g}"
    if temperature == 0:  # greedy: every token is the raw policy's argmax
        for prompt, g in zip(PROMPTS, gens):
            with torch.no_grad():
                logits = policy(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == g.token_ids
    assert shipped.repetition_penalty == 5.0  # the model's own config is left as it was


@pytest.mark.parametrize("disable_dropout", [True, False])
def test_first_ppo_epoch_ratio_is_exactly_one_with_lora_dropout(disable_dropout, monkeypatch):
    from lightning_memrl import GRPOSettings, LoraSettings, MemRLDataModule, SyntheticTaskSettings

    module = MemRLModule(
        "tiny",
        lora=LoraSettings(r=4, alpha=8, dropout=0.3),
        generation=GenerationSettings(temperature=1.0, max_new_tokens=8),
        grpo=GRPOSettings(group_size=2, ppo_epochs=2, kl_coef=0.1, disable_dropout=disable_dropout),
    )
    module.configure_model()
    torch.manual_seed(1)
    with torch.no_grad():  # non-zero lora_B: the adapters' (dropped-out) input matters
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    data = MemRLDataModule(batch_size=2, synthetic=SyntheticTaskSettings(num_tasks=2, sentences_per_chunk=1))
    data.setup()
    torch.manual_seed(0)
    rollouts = scored_rollouts(module, data, [1.0, 0.0, 0.5, 0.0])
    ratios, loss = [], losses.policy_loss

    def recording_loss(settings, logprobs, old, *args):
        mask = args[-1]
        ratios.append(torch.exp(logprobs.detach() - old)[mask])
        return loss(settings, logprobs, old, *args)

    class _Opt:
        param_groups = [{"lr": 0.0}]  # no step: every epoch sees the rollout's weights

        def step(self):
            pass

        def zero_grad(self, set_to_none=True):
            module.policy.zero_grad(set_to_none=True)

    monkeypatch.setattr(losses, "policy_loss", recording_loss)
    module.optimizers, module.lr_schedulers = _Opt, lambda: None
    module.manual_backward = lambda value: value.backward()
    module.update(rollouts)
    first = torch.cat(ratios[: len(ratios) // 2])
    if disable_dropout:
        assert torch.equal(first, torch.ones_like(first))  # identical weights: ratio 1, nothing clipped
    else:  # dropout left in the training forward: noisy ratios, but never from the old log-probs' side
        assert float((first - 1).abs().max()) > 0.01
