"""The teacher shared by the teacher-scored credit methods, against direct computations on the tiny model."""

from __future__ import annotations

import pytest
import torch
from teacher_fakes import batch, memagent_trajectory

from lightning_memrl import MemRLModule
from lightning_memrl.credit.attribution import AttributionCredit, answer_attributions
from lightning_memrl.credit.info_gain import InformationGainReward
from lightning_memrl.credit.memory_turns import grouped_zscore
from lightning_memrl.credit.teacher import AnswerPrompts, score_answers
from lightning_memrl.credit.tips import PotentialTurnShaping
from lightning_memrl.errors import ConfigError
from lightning_memrl.models import LoraSettings
from lightning_memrl.settings import GenerationSettings, GRPOSettings
from lightning_memrl.types import Task
from lightning_memrl.workflows.memory_r1 import MemoryR1Workflow

TEMPERATURE = 0.7
TASK = Task("Where does Alice live?", "c", ["Paris"], id="t0")
MEMORIES = ["Alice lives in Paris.", "", "Bob met Alice in Rome last year and they talked."]


def _module(kl_coef: float = 0.0, lora: LoraSettings | None = None) -> MemRLModule:
    torch.manual_seed(0)
    module = MemRLModule(
        "tiny", lora=lora, grpo=GRPOSettings(kl_coef=kl_coef), generation=GenerationSettings(temperature=TEMPERATURE)
    )
    module.configure_model()
    return module


def _direct_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:  # [A]
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer).unsqueeze(-1)).squeeze(-1)


def _perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def test_teacher_scores_match_a_direct_computation_under_the_reference_not_the_policy():
    module = _module()  # no LoRA, kl_coef 0: no reference yet; the teacher loads it once
    assert module._reference is None
    _perturb(module.policy)  # the policy moved away from the initial weights; the teacher must not follow
    builder = AnswerPrompts(module.workflow, module.tokenizer)
    prompts = [builder.prompt(TASK.question, m) for m in MEMORIES]
    answer = builder.answer(TASK)
    scores = score_answers(module, prompts + prompts[:1], [answer] * 4, token_budget=120)  # 2+ micro-batches
    reference = module._reference
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    for row, prompt in enumerate(prompts):
        direct = _direct_logprobs(reference, prompt, answer)
        torch.testing.assert_close(scores.per_token[row], direct, atol=1e-4, rtol=1e-4)
        assert float(scores.total[row]) == pytest.approx(float(direct.sum()), abs=1e-3)
        assert float(scores.mean[row]) == pytest.approx(float(direct.mean()), abs=1e-4)
        policy_score = float(_direct_logprobs(module.policy, prompt, answer).sum())
        assert abs(policy_score - float(scores.total[row])) > 1e-2  # not the (perturbed) policy's
    assert float(scores.total[3]) == float(scores.total[0])  # a repeated pair is scored once, copied
    assert scores.mask.sum().item() == 4 * len(answer)
    assert module.policy.training  # train mode restored


def test_teacher_is_the_lora_base_with_adapters_disabled():
    module = _module(lora=LoraSettings(r=2, alpha=4))
    _perturb(module.policy, 0.5)  # only the adapters require grad: they move, the base does not
    builder = AnswerPrompts(module.workflow, module.tokenizer)
    prompt, answer = builder.prompt(TASK.question, MEMORIES[0]), builder.answer(TASK)
    scores = score_answers(module, [prompt], [answer])
    with module.policy.disable_adapter():
        base = _direct_logprobs(module.policy, prompt, answer)
    adapted = _direct_logprobs(module.policy, prompt, answer)
    assert float(scores.total[0]) == pytest.approx(float(base.sum()), abs=1e-3)
    assert abs(float(adapted.sum()) - float(base.sum())) > 1e-2


def test_prompt_builder_fills_the_workflow_answer_template_and_locates_the_memory():
    module = _module()
    builder = AnswerPrompts(module.workflow, module.tokenizer)
    ids, start, end = builder.prompt_with_span(TASK.question, "Alice lives in Paris.")
    text = module.tokenizer.decode(ids)
    assert "Question: Where does Alice live?" in text and "Alice lives in Paris." in text
    assert module.tokenizer.decode(ids[start:end]) == "Alice lives in Paris."
    empty_ids, s, e = builder.prompt_with_span(TASK.question, "")  # the workflow's empty memory is shown
    assert module.tokenizer.decode(empty_ids[s:e]) == module.workflow.memory.empty_text
    assert module.tokenizer.decode(builder.answer(TASK)) == "\\boxed{Paris}"
    with pytest.raises(ValueError, match="task 'x' has no gold answer"):
        builder.answer(Task("q", "c", [], id="x"))


def test_answer_attributions_are_gradient_times_input_over_the_memory_span():
    module = _module()
    builder = AnswerPrompts(module.workflow, module.tokenizer)
    answer = builder.answer(TASK)
    rows = [builder.prompt_with_span(TASK.question, m) for m in MEMORIES]
    got = answer_attributions(module, [r[0] for r in rows], [answer] * 3, [(r[1], r[2]) for r in rows], 120)
    reference = module._reference
    for row, (prompt, start, end) in enumerate(rows):
        embeddings = reference.get_input_embeddings()(torch.tensor([prompt + answer])).detach().requires_grad_(True)
        logits = reference(inputs_embeds=embeddings).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
        total = torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer).unsqueeze(-1)).sum()
        (grad,) = torch.autograd.grad(total, embeddings)
        direct = (grad * embeddings.detach())[0, start:end].sum()
        assert float(got[row]) == pytest.approx(float(direct), abs=1e-4)
    assert all(p.grad is None for p in module.policy.parameters())  # no parameter gradients
    assert not got.requires_grad


def test_grouped_zscore_uses_the_unbiased_std_and_zero_for_a_lone_entry():
    # key a: [1, 3] -> mean 2, std sqrt(((1)^2 + (1)^2) / 1) = 1.4142 -> [-0.7071, 0.7071]; key b alone -> 0
    got = grouped_zscore(torch.tensor([1.0, 3.0, 5.0]), ["a", "a", "b"], eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-0.70710678, 0.70710678, 0.0]))


@pytest.mark.parametrize("callback", [PotentialTurnShaping, InformationGainReward, AttributionCredit])
def test_teacher_scored_methods_refuse_a_memory_bank_workflow_at_setup(callback):
    module = MemRLModule("tiny", workflow=MemoryR1Workflow())
    with pytest.raises(ConfigError, match=f"{callback.__name__} cannot serve MemoryR1Workflow.*memory_per_chunk"):
        callback().setup(None, module, "fit")
    callback().setup(None, MemRLModule("tiny"), "fit")  # MemAgent is served


def test_methods_score_through_the_real_teacher(monkeypatch):
    # InfoMem's gain and TIPS's Φ_K - Φ_0 from the live teacher equal the direct per-token / summed computation
    module = _module(kl_coef=0.01)  # the run's own reference is the teacher
    logged: dict[str, float] = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, float(value)))
    builder = AnswerPrompts(module.workflow, module.tokenizer)
    answer = builder.answer(TASK)
    final = {m: _direct_logprobs(module._reference, builder.prompt(TASK.question, m), answer) for m in MEMORIES}
    empty = _direct_logprobs(module._reference, builder.prompt(TASK.question, ""), answer)
    trajectories = [memagent_trajectory([m], answer="\\boxed{Paris}") for m in MEMORIES[:2]]
    for trajectory in trajectories:
        trajectory.task = TASK
    rollouts = batch(trajectories, 2, [0.0, 0.0])
    rollouts.rewards = torch.zeros(2)
    InformationGainReward().on_rewards(None, module, rollouts)
    gains = [float(final[m].mean() - empty.mean()) for m in MEMORIES[:2]]
    assert logged["train/info_gain/gain"] == pytest.approx(sum(gains) / 2, abs=1e-4)
    assert logged["train/info_gain/teacher_rows"] == 4.0 and logged["train/info_gain/teacher_seconds"] > 0
    PotentialTurnShaping().on_advantages(None, module, rollouts)
    phi_gain = [float(final[m].sum() - empty.sum()) for m in MEMORIES[:2]]
    assert logged["train/tips/potential_gain"] == pytest.approx(sum(phi_gain) / 2, abs=1e-3)
