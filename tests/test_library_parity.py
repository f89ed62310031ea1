"""Where a maintained library defines a number we use: SQuAD EM/F1 (torchmetrics), LR schedules (transformers),
the hashing embedder (scikit-learn)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_memrl.memory.bank import MemoryBank
from lightning_memrl.memory.embedders import HashingEmbedder
from lightning_memrl.rewards import exact_match, token_f1
from lightning_memrl.settings import OptimizerSettings, build_optimizer

# ----------------------------------------------------------------------------- SQuAD exact match and token F1
SQUAD_CASES = [
    ("Lisbon", ["Lisbon"]),
    ("the Lisbon.", ["lisbon"]),  # articles, punctuation and case go
    ("He moved to Lisbon, Portugal", ["Lisbon"]),
    ("an apple a day", ["The apple, a  day!"]),
    ("7 May 2023", ["May 7, 2023", "7 May"]),  # best of several gold answers
    ("Rosa", ["Maria", "Rosa Diaz"]),
    ("cat cat cat", ["cat"]),  # clipped overlap
    ("", ["x"]),
    ("the", ["a"]),  # both empty after normalisation
    ("Paris", ["Lisbon"]),
    ("café—résumé", ["Café résumé"]),  # non-ASCII dash is not string.punctuation in either
]


@pytest.mark.parametrize(("prediction", "answers"), SQUAD_CASES)
def test_exact_match_and_token_f1_equal_torchmetrics_squad(prediction, answers):
    """Ours is the SQuAD v1.1 script's definition; torchmetrics ports the same script (scores in percent)."""
    from torchmetrics.functional.text import squad

    preds = [{"prediction_text": prediction, "id": "0"}]
    target = [{"answers": {"answer_start": [0] * len(answers), "text": answers}, "id": "0"}]
    theirs = squad(preds, target)
    assert exact_match(prediction, answers) * 100 == pytest.approx(float(theirs["exact_match"]), abs=1e-4)
    assert token_f1(prediction, answers) * 100 == pytest.approx(float(theirs["f1"]), abs=1e-4)


# ----------------------------------------------------------------------------- learning-rate schedules
def _learning_rates(settings: OptimizerSettings, total: int | None, steps: int) -> list[float]:
    weight = torch.nn.Parameter(torch.zeros(2))
    scheduler = build_optimizer(settings, [weight], [], None, total)["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(steps):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def test_cosine_schedule_is_transformers_cosine_with_min_lr():
    rates = _learning_rates(OptimizerSettings(lr=1.0, warmup_steps=4, schedule="cosine"), total=12, steps=13)
    # warm-up s / 4 (step 0 at 0, as in transformers/TRL), then 0.1 + 0.9 * (1 + cos(pi * (s - 4) / 8)) / 2
    by_hand = [0.0, 0.25, 0.5, 0.75] + [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 4) / 8)) for s in range(4, 13)]
    assert rates == pytest.approx(by_hand, abs=1e-12)
    assert (rates[4], rates[8], rates[12]) == pytest.approx((1.0, 0.55, 0.1))
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    reference = get_scheduler("cosine_with_min_lr", optimizer, 4, 12, scheduler_specific_kwargs={"min_lr_rate": 0.1})
    assert [reference.lr_lambdas[0](s) for s in range(13)] == pytest.approx(rates, abs=1e-12)


def test_constant_schedule_with_and_without_warm_up():
    assert _learning_rates(OptimizerSettings(lr=0.3), total=10, steps=4) == [0.3] * 4  # the defaults: unchanged
    assert _learning_rates(OptimizerSettings(lr=3.0, warmup_steps=3), total=None, steps=5) == pytest.approx(
        [0.0, 1.0, 2.0, 3.0, 3.0]
    )
    # cosine without a known number of steps: warm-up, then constant
    assert _learning_rates(OptimizerSettings(lr=2.0, warmup_steps=2, schedule="cosine"), total=None, steps=4) == [
        0.0,
        1.0,
        2.0,
        2.0,
    ]


# ----------------------------------------------------------------------------- hashing embedder
MEMORIES = [
    "Caroline went to an LGBTQ support group on 7 May 2023",
    "Melanie painted a sunrise over the lake last year",
    "Caroline is researching adoption agencies",
    "Melanie ran a charity race for mental health",
    "Melanie's kids love dinosaurs and nature",
    "Caroline moved from Sweden four years ago",
]
QUERIES = [  # (question, index of the memory that answers it)
    ("When did Caroline go to the LGBTQ support group?", 0),
    ("What did Melanie paint?", 1),
    ("What is Caroline researching?", 2),
    ("What did Melanie run a race for?", 3),
    ("What do Melanie's kids like?", 4),
    ("Where did Caroline move from?", 5),
]


def answer_ranks(embedder: HashingEmbedder) -> list[int]:
    """Rank (0: first) of the memory that answers each of :data:`QUERIES` under dense retrieval."""
    bank = MemoryBank(retriever="dense", embedder=embedder)
    for text in MEMORIES:
        bank.add(text)
    ranks = []
    for question, answer in QUERIES:
        texts = [entry.text for entry, _ in bank.retrieve(question, k=len(MEMORIES))]
        ranks.append(texts.index(MEMORIES[answer]) if MEMORIES[answer] in texts else len(MEMORIES))
    return ranks


def test_hashing_embedder_retrieves_the_answering_memory_first():
    """The former blake2b-hashed embedder ranked the answer to "What did Melanie paint?" third (hash collisions)."""
    assert answer_ranks(HashingEmbedder()) == [0] * len(QUERIES)


def test_hashing_embedder_vectors_are_the_same_in_every_process():
    """MurmurHash3 (scikit-learn), not Python's salted ``hash``: pinned values hold whatever ``PYTHONHASHSEED`` is.

    4 words and 3 bigrams fall in 8 signed buckets as (1, 0, 0, 1, -1, 2, 1, 1), L2 norm 3; case and
    punctuation do not change the features.
    """
    embedder = HashingEmbedder(dim=8)
    vectors = embedder.embed(["Alice moved to Lisbon", "alice, MOVED to lisbon!", ""])  # [3, 8]
    pinned = torch.tensor([1.0, 0.0, 0.0, 1.0, -1.0, 2.0, 1.0, 1.0]) / 3
    torch.testing.assert_close(vectors[0], pinned)
    torch.testing.assert_close(vectors[1], pinned)
    assert vectors.dtype == torch.float32 and not vectors[2].any()  # no word: a zero vector
    assert embedder.embed([]).shape == (0, 8)
