"""AttributionCredit on hand-built MemAgent batches with faked attributions."""

from __future__ import annotations

import pytest
import torch
from teacher_fakes import TASK, FakeModule, batch, memagent_trajectory

from lightning_memrl.credit import attribution
from lightning_memrl.credit.attribution import AttributionCredit
from lightning_memrl.credit.teacher import AnswerPrompts
from lightning_memrl.errors import ConfigError


def test_attribution_credit_goes_to_each_memory_turn_advantage(monkeypatch):
    # a(a1) = 2, a(a2) = 0, a(b1) = 1 (b2 is a frozen turn: not scored); one group: mean 1, std 1 -> [1, -1, 0]
    # weight 0.1: A turn 0 +0.1, A turn 1 -0.1, B turn 0 +0; answers unchanged
    scores = {"a1": 2.0, "a2": 0.0, "b1": 1.0}
    asked: list[str] = []

    def fake(module, items):
        asked.extend(m for _, m in items)
        return torch.tensor([scores[m] for _, m in items])

    rollouts = batch([memagent_trajectory(["a1", "a2"]), memagent_trajectory(["b1", "b2"], frozen=(1,))], 2, [0.5, 0.0])
    callback = AttributionCredit(weight=0.1)
    monkeypatch.setattr(callback, "memory_attributions", fake)
    module = FakeModule()
    callback.on_advantages(None, module, rollouts)
    assert asked == ["a1", "a2", "b1"]
    # rows: A turn 0, A turn 1, A answer, B turn 0, B answer
    expected = torch.tensor([[0.6, 0.6], [0.4, 0.4], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(rollouts.advantages, expected, atol=1e-5, rtol=0)
    assert module.logged["train/attribution/score"] == pytest.approx(1.0)  # mean(2, 0, 1)


def test_mean_aggregation_divides_by_the_memory_token_count(monkeypatch, tiny_tokenizer):
    # answer_attributions (the teacher pass) faked to sum 4.0 and 3.0; mean divides by each memory's token count
    monkeypatch.setattr(attribution, "answer_attributions", lambda module, p, a, spans: torch.tensor([4.0, 3.0]))
    module = FakeModule(tiny_tokenizer)
    memories = ["Alice lives in Paris.", "Bob"]
    builder = AnswerPrompts(module.workflow, tiny_tokenizer)
    counts = [e - s for _, s, e in (builder.prompt_with_span(TASK.question, m) for m in memories)]
    got = AttributionCredit(aggregation="mean").memory_attributions(module, [(TASK, m) for m in memories])
    torch.testing.assert_close(got, torch.tensor([4.0 / counts[0], 3.0 / counts[1]]))
    assert counts[0] > counts[1] >= 1


def test_attribution_rejects_bad_options():
    with pytest.raises(ConfigError, match="aggregation must be"):
        AttributionCredit(aggregation="max")
    with pytest.raises(ConfigError, match="weight must be"):
        AttributionCredit(weight=-1)
