"""Shared-prefix prefill: one KV prefill per group gives the same tokens and log-probs as none."""

from __future__ import annotations

import pytest
import torch

from lightning_memrl import MemRLModule
from lightning_memrl.learner import update_prefix_groups
from lightning_memrl.models import LoraSettings
from lightning_memrl.rollout.hf import RolloutEngine
from lightning_memrl.rollout.prefix import shared_prefix_groups
from lightning_memrl.settings import GenerationSettings


def test_groups_are_consecutive_prompts_with_a_long_enough_common_prefix() -> None:
    prompts = [[1, 2, 3, 4, 9], [1, 2, 3, 5], [1, 2, 3, 4, 8, 8], [7, 7, 7], [7, 7, 6]]
    assert shared_prefix_groups(prompts, min_shared=3) == [(3, [0, 1, 2]), (2, [3]), (2, [4])]
    # the prefix always leaves a token of every member's prompt: identical prompts share len - 1
    assert shared_prefix_groups([[1, 2, 3], [1, 2, 3]], min_shared=1) == [(2, [0, 1])]
    assert shared_prefix_groups([[1, 2, 3], [1, 2, 3]], min_shared=3) == [(2, [0]), (2, [1])]
    # a common header alone (3 of 8 shared tokens) does not merge two groups
    header_groups = [[0, 0, 0, 1, 1, 1, 1, 1, 5], [0, 0, 0, 1, 1, 1, 1, 1, 6], [0, 0, 0, 2, 2, 2, 2, 2, 5]]
    assert shared_prefix_groups(header_groups, min_shared=2) == [(8, [0, 1]), (8, [2])]


def test_labels_group_prompts_wherever_they_are() -> None:
    prompts = [[1, 2, 3, 4], [9, 9, 9], [1, 2, 3, 5], [9, 9, 8]]
    groups = shared_prefix_groups(prompts, min_shared=2, labels=["a", "b", "a", "b"])
    assert groups == [(3, [0, 2]), (2, [1, 3])]
    # a labelled group that shares too little is split into single prompts
    assert shared_prefix_groups([[1, 2], [3, 4]], min_shared=1, labels=[0, 0]) == [(1, [0]), (1, [1])]


def _group_prompts(tokenizer) -> list[list[int]]:
    shared = "Question: what is the secret code of Alice? Section: The secret code of Alice is 1234. A train"
    notes = ["Notes: none.", "Notes: Alice 1234 and more notes here.", "Notes: Bob."]
    other = "Problem: find the code of Bob. Section: nothing here"
    texts = [f"{shared} {n}" for n in notes] + [f"{other} {n}" for n in notes[:2]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_shared_prefix_generation_equals_unshared(tiny_model, tiny_tokenizer) -> None:
    prompts = _group_prompts(tiny_tokenizer)
    shared = RolloutEngine(tiny_model, tiny_tokenizer, min_shared_prefix=8)
    groups = shared_prefix_groups(prompts, 8)
    assert [rows for _, rows in groups] == [[0, 1, 2], [3, 4]]  # the path under test is taken
    plain = RolloutEngine(tiny_model, tiny_tokenizer, share_prefixes=False)
    settings = GenerationSettings(temperature=0.0, max_new_tokens=8)
    with_sharing, without = shared.generate(prompts, settings), plain.generate(prompts, settings)
    for a, b in zip(with_sharing, without):
        assert a.token_ids == b.token_ids and a.truncated == b.truncated
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_shared_prefix_sampling_logprobs_match_a_forward_pass(tiny_model, tiny_tokenizer) -> None:
    prompts = _group_prompts(tiny_tokenizer)
    engine = RolloutEngine(tiny_model, tiny_tokenizer, min_shared_prefix=8)
    torch.manual_seed(0)
    generations = engine.generate(prompts, GenerationSettings(temperature=0.8, top_p=0.95, max_new_tokens=8))
    for prompt, gen in zip(prompts, generations):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(gen.logprobs, expected, atol=1e-4, rtol=0)


def test_members_prefill_only_the_rest_of_their_prompts(tiny_model, tiny_tokenizer) -> None:
    prompts = _group_prompts(tiny_tokenizer)
    seen: list[int] = []
    hook = tiny_model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    try:
        settings = GenerationSettings(temperature=0.0, max_new_tokens=1)
        RolloutEngine(tiny_model, tiny_tokenizer, share_prefixes=False).generate(prompts, settings)
        unshared = sum(seen)
        seen.clear()
        RolloutEngine(tiny_model, tiny_tokenizer, min_shared_prefix=8).generate(prompts, settings)
        shared = sum(seen)
    finally:
        hook.remove()
    groups = shared_prefix_groups(prompts, 8)
    widest_prefix = max(length for length, _ in groups)
    # the prefix pass embeds [groups, P]; the members then embed only the columns after it
    assert shared == unshared + len(groups) * widest_prefix - len(prompts) * widest_prefix
    assert shared < unshared


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_update_shares_prefixes_exactly_values_and_gradients(tiny_tokenizer, lora) -> None:
    shared = "Question: what is the secret code of Alice? Section: The secret code of Alice is 1234. A train"
    texts = [f"{shared} Notes: none.", f"{shared} Notes: Alice 1234.", "Problem: Bob? Section: x", f"{shared} B"]
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    response = torch.tensor([[13, 14, 15], [16, 17, 0], [18, 0, 0], [19, 20, 21]])
    mask = (response > 0).long()
    results = []
    for share in (True, False):
        module = MemRLModule("tiny", lora=lora, share_prefixes=share)
        torch.manual_seed(0)  # the same LoRA initialisation for both
        module.configure_model()
        torch.manual_seed(1)
        for param in module.policy.parameters():  # LoRA B starts at 0: move it so adapters matter
            if param.requires_grad:
                param.data.add_(0.05 * torch.randn_like(param))
        groups = update_prefix_groups(module, prompts)
        assert bool(groups) == share and (not share or sorted(len(r) for _, r in groups) == [1, 3])
        logprobs, entropy = module.sequence_logprobs(module.policy, prompts, response, mask, with_entropy=True)
        (logprobs * mask).sum().backward()
        grads = [p.grad.clone() for p in module.policy.parameters() if p.requires_grad]
        results.append((logprobs.detach(), entropy, grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    m = mask.bool()
    torch.testing.assert_close(lp_a[m], lp_b[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(ent_a[m], ent_b[m], atol=1e-4, rtol=0)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
