"""Synthetic memory tasks: facts about people hidden among filler chunks, asked about at the end."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

# --------------------------------------------------------------------------- synthetic tasks
_NAMES = [
    "Alice",
    "Bruno",
    "Chen",
    "Dara",
    "Elif",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kemal",
    "Lena",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Viktor",
    "Wen",
    "Ximena",
    "Yusuf",
    "Zofia",
]


_FILLER = [
    "The weather in the valley stayed mild for most of the season.",
    "A delivery of fresh bread arrived at the market before noon.",
    "The old library opened a new reading room on the second floor.",
    "Several boats were repaired at the harbour during the week.",
    "The choir practised a new song in the town hall.",
    "Farmers reported a good harvest of apples and pears.",
    "The museum added a small exhibit about early clocks.",
    "A train from the north was delayed by heavy snow.",
    "Children planted trees along the river path.",
    "The bakery changed its opening hours for the holidays.",
    "A local team won the regional chess tournament.",
    "The bridge over the canal was painted blue.",
]


@dataclass
class SyntheticTaskSettings:
    """Knobs of the synthetic long-context memory tasks.

    Args:
        num_tasks: tasks to generate.
        min_chunks: fewest chunks a task's context has.
        max_chunks: most chunks a task's context has.
        sentences_per_chunk: filler sentences in each chunk (length of a chunk).
        distractor_facts: facts about other people hidden in the context.
        hops: 1 = the answer is stated; 2 = the asked person "uses the same code as" another,
            whose code is stated in another chunk.
        seed: generator seed (a different seed gives disjoint held-out tasks).
        distractor_placement: ``random``: every fact lands in a chunk drawn at random; ``spread``: the
            distractors go one per chunk that holds no evidence (cycling when there are more
            distractors than such chunks), so every other chunk states a code of the same pattern.
        hop_chunks: 2-hop tasks: ``random``: each of the two facts in a chunk drawn at random (they may
            share one); ``distinct``: the two facts in two different chunks (needs ``min_chunks >= 2``).
        two_hop_share: None: every task has ``hops`` hops; a number in [0, 1]: each task is 2-hop with
            that probability, else 1-hop (one validation set scores both, reported by hops).
    """

    num_tasks: int = 64
    min_chunks: int = 2
    max_chunks: int = 3
    sentences_per_chunk: int = 2
    distractor_facts: int = 2
    hops: int = 1
    seed: int = 0
    distractor_placement: str = "random"
    hop_chunks: str = "random"
    two_hop_share: float | None = None


def _check(config: SyntheticTaskSettings) -> None:
    """Stop on settings the generator cannot honour, naming the option."""
    if config.min_chunks < 1 or config.max_chunks < config.min_chunks:
        raise DataError(f"synthetic: need 1 <= min_chunks <= max_chunks, got {config.min_chunks}, {config.max_chunks}")
    for knob in ("num_tasks", "sentences_per_chunk", "distractor_facts"):
        if getattr(config, knob) < 0:
            raise DataError(f"synthetic: {knob} must be >= 0, got {getattr(config, knob)}")
    if config.hops not in (1, 2):
        raise DataError(f"synthetic: hops must be 1 or 2, got {config.hops}")
    if config.distractor_placement not in ("random", "spread"):
        placement = config.distractor_placement
        raise DataError(f"synthetic: distractor_placement must be random or spread, got {placement!r}")
    if config.hop_chunks not in ("random", "distinct"):
        raise DataError(f"synthetic: hop_chunks must be random or distinct, got {config.hop_chunks!r}")
    share = config.two_hop_share
    if share is not None and not 0.0 <= share <= 1.0:
        raise DataError(f"synthetic: two_hop_share must be null or in [0, 1], got {share}")
    two_hop = config.hops == 2 or bool(share)
    if two_hop and config.hop_chunks == "distinct" and config.min_chunks < 2:
        raise DataError("synthetic: hop_chunks: distinct needs min_chunks >= 2 (the two facts go to different chunks)")
    if config.distractor_facts + (2 if two_hop else config.hops) > len(_NAMES):
        raise DataError(f"synthetic: at most {len(_NAMES) - (2 if two_hop else config.hops)} distractor_facts")


def _fact_chunks(config: SyntheticTaskSettings, rng: random.Random, num_chunks: int, hops: int) -> list[int] | None:
    """The chunk of every fact (evidence first) under the placement options; None: draw as the defaults do."""
    if config.distractor_placement == "random" and (hops == 1 or config.hop_chunks == "random"):
        return None
    if hops == 2 and config.hop_chunks == "distinct":
        evidence = rng.sample(range(num_chunks), k=2)
    else:
        evidence = [rng.randrange(num_chunks) for _ in range(hops)]
    if config.distractor_placement == "random":
        return evidence + [rng.randrange(num_chunks) for _ in range(config.distractor_facts)]
    others = [c for c in range(num_chunks) if c not in evidence] or list(range(num_chunks))
    rng.shuffle(others)
    return evidence + [others[i % len(others)] for i in range(config.distractor_facts)]


def generate_synthetic_tasks(config: SyntheticTaskSettings) -> list[Task]:
    """Reproducible tasks: secret codes hidden among filler and distractors across chunks."""
    _check(config)
    rng = random.Random(config.seed)
    tasks = []
    for index in range(config.num_tasks):
        hops = config.hops if config.two_hop_share is None else (2 if rng.random() < config.two_hop_share else 1)
        num_chunks = rng.randint(config.min_chunks, config.max_chunks)
        chunks = [rng.sample(_FILLER, k=min(config.sentences_per_chunk, len(_FILLER))) for _ in range(num_chunks)]
        people = rng.sample(_NAMES, k=hops + config.distractor_facts)
        code = f"{rng.randint(1000, 9999)}"
        target = people[0]
        facts = []
        if hops == 1:
            facts.append(f"The secret code of {target} is {code}.")
        else:
            facts.append(f"{target} uses the same secret code as {people[1]}.")
            facts.append(f"The secret code of {people[1]} is {code}.")
        for other in people[hops:]:
            facts.append(f"The secret code of {other} is {rng.randint(1000, 9999)}.")
        placed = _fact_chunks(config, rng, num_chunks, hops)
        evidence = []
        for i, fact in enumerate(facts):
            chunk = rng.randrange(num_chunks) if placed is None else placed[i]
            chunks[chunk].insert(rng.randint(0, len(chunks[chunk])), fact)
            if i < hops:
                evidence.append(chunk)
        meta = {"evidence_chunks": sorted(evidence), "num_chunks": num_chunks, "answer_chunk": evidence[-1]}
        tasks.append(
            Task(
                question=f"What is the secret code of {target}?",
                context=[" ".join(c) for c in chunks],
                answers=[code],
                id=f"synthetic-{config.seed}-{index}",
                meta={**meta, "hops": hops},
            )
        )
    return tasks


def synthetic_corpus() -> Iterator[str]:
    """Text that covers the synthetic tasks and prompts (trains the tiny test tokenizer)."""
    for hops in (1, 2):
        for task in generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=100, hops=hops, seed=hops)):
            yield task.question
            yield from task.context
    yield "Problem Memory Section Question Answer No previous memory. \\boxed{} Update the memory."
    yield "0123456789 {}[]()<>.,;:!?'\"-_/\\ system user assistant"
