"""lightning_memrl.data.synthetic: the multi-chunk secret-code tasks and their YAML settings."""

from __future__ import annotations

import random
import re
from pathlib import Path

import jsonargparse
import pytest
import yaml

import lightning_memrl
from lightning_memrl.data.datamodule import MemRLDataModule
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

QUESTION = re.compile(r"^What is the secret code of (\w+)\?$")


def _chunk_with(task: Task, sentence: str) -> list[int]:
    return [i for i, chunk in enumerate(task.context) if sentence in chunk]


@pytest.mark.parametrize("hops", [1, 2])
def test_synthetic_same_seed_gives_identical_tasks(hops):
    config = SyntheticTaskSettings(num_tasks=25, hops=hops, seed=3, min_chunks=1, max_chunks=4)
    first = generate_synthetic_tasks(config)
    random.seed(12345)  # the global random state must not matter
    second = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=25, hops=hops, seed=3, min_chunks=1, max_chunks=4)
    )
    assert first == second
    assert len(first) == 25


def test_synthetic_different_seed_gives_different_tasks():
    a = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=20, seed=0))
    b = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=20, seed=1))
    assert [t.context for t in a] != [t.context for t in b]
    assert [(t.question, t.answers) for t in a] != [(t.question, t.answers) for t in b]
    assert not {t.id for t in a} & {t.id for t in b}


def test_synthetic_ids_and_answers():
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=10, seed=7))
    assert [t.id for t in tasks] == [f"synthetic-7-{i}" for i in range(10)]
    for task in tasks:
        assert QUESTION.match(task.question)
        assert isinstance(task.context, list) and all(isinstance(c, str) and c for c in task.context)
        assert len(task.answers) == 1 and re.fullmatch(r"\d{4}", task.answers[0])


def test_synthetic_zero_tasks():
    assert generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=0)) == []


@pytest.mark.parametrize(("min_chunks", "max_chunks"), [(1, 1), (3, 3), (2, 5), (1, 6)])
def test_synthetic_respects_min_and_max_chunks(min_chunks, max_chunks):
    tasks = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=200, min_chunks=min_chunks, max_chunks=max_chunks))
    counts = [len(t.context) for t in tasks]
    assert all(min_chunks <= n <= max_chunks for n in counts)
    assert min(counts) == min_chunks and max(counts) == max_chunks  # both ends are drawn
    assert all(t.meta["num_chunks"] == len(t.context) for t in tasks)


@pytest.mark.parametrize(("hops", "distractors", "per_chunk"), [(1, 0, 1), (1, 3, 2), (2, 2, 3), (2, 0, 0)])
def test_synthetic_sentence_budget(hops, distractors, per_chunk):
    """Every chunk holds ``sentences_per_chunk`` filler sentences plus the facts put into it."""
    config = SyntheticTaskSettings(num_tasks=30, hops=hops, distractor_facts=distractors, sentences_per_chunk=per_chunk)
    for task in generate_synthetic_tasks(config):
        sentences = sum(chunk.count(".") for chunk in task.context)
        assert sentences == len(task.context) * per_chunk + hops + distractors
        assert " ".join(task.context).count("The secret code of ") == 1 + distractors


@pytest.mark.parametrize("distractors", [0, 2, 5])
def test_synthetic_one_hop_answer_is_stated_in_the_context(distractors):
    tasks = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=60, hops=1, distractor_facts=distractors, max_chunks=5, seed=11)
    )
    for task in tasks:
        target = QUESTION.match(task.question).group(1)
        (code,) = task.answers
        holding = _chunk_with(task, f"The secret code of {target} is {code}.")
        assert len(holding) == 1, task
        assert task.meta["evidence_chunks"] == holding
        assert "uses the same secret code as" not in " ".join(task.context)


@pytest.mark.parametrize("distractors", [0, 3])
def test_synthetic_two_hop_facts_are_present(distractors):
    tasks = generate_synthetic_tasks(
        SyntheticTaskSettings(num_tasks=60, hops=2, distractor_facts=distractors, max_chunks=5, seed=5)
    )
    for task in tasks:
        target = QUESTION.match(task.question).group(1)
        (code,) = task.answers
        text = " ".join(task.context)
        bridge = re.findall(rf"{target} uses the same secret code as (\w+)\.", text)
        assert len(bridge) == 1, task
        (other,) = bridge
        assert other != target
        bridge_chunks = _chunk_with(task, f"{target} uses the same secret code as {other}.")
        code_chunks = _chunk_with(task, f"The secret code of {other} is {code}.")
        assert len(bridge_chunks) == 1 and len(code_chunks) == 1, task
        # the asked person's code is never stated: it takes both hops
        assert f"The secret code of {target} is" not in text
        # one entry per evidence fact (bridge, then code fact), sorted; both may sit in one chunk
        assert task.meta["evidence_chunks"] == sorted(bridge_chunks + code_chunks)
        assert all(0 <= c < task.meta["num_chunks"] for c in task.meta["evidence_chunks"])


def test_synthetic_distractors_are_about_other_people():
    for task in generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=40, hops=1, distractor_facts=6)):
        target = QUESTION.match(task.question).group(1)
        people = re.findall(r"The secret code of (\w+) is \d{4}\.", " ".join(task.context))
        assert len(people) == 7 and len(set(people)) == 7
        assert people.count(target) == 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"min_chunks": 0}, "min_chunks"),
        ({"min_chunks": -1, "max_chunks": 2}, "min_chunks"),
        ({"min_chunks": 4, "max_chunks": 3}, "max_chunks"),
        ({"hops": 0}, "hops"),
        ({"hops": 3}, "hops"),
        ({"hops": 1, "distractor_facts": 26}, "distractor_facts"),
        ({"hops": 2, "distractor_facts": 25}, "distractor_facts"),
    ],
)
def test_synthetic_bad_knobs_raise_data_error(knobs, message):
    with pytest.raises(DataError, match=message):
        generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, **knobs))


@pytest.mark.parametrize(("hops", "distractors"), [(1, 25), (2, 24)])
def test_synthetic_largest_distractor_count_is_allowed(hops, distractors):
    (task,) = generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, hops=hops, distractor_facts=distractors))
    assert " ".join(task.context).count("The secret code of ") == 1 + distractors


@pytest.mark.parametrize(
    "knobs", [{"distractor_facts": -1}, {"hops": 2, "distractor_facts": -2}, {"sentences_per_chunk": -1}]
)
def test_synthetic_negative_knobs_raise_data_error(knobs):
    with pytest.raises(DataError):
        generate_synthetic_tasks(SyntheticTaskSettings(num_tasks=1, **knobs))


def test_synthetic_settings_keep_their_yaml_keys():
    """``data.init_args.synthetic`` / ``synthetic_val`` of a config become :class:`SyntheticTaskSettings`."""
    assert "SyntheticTaskSettings" in lightning_memrl.__all__ and not hasattr(lightning_memrl, "SyntheticTaskConfig")
    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "memagent" / "tiny.yaml").read_text())["data"][
        "init_args"
    ]
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(MemRLDataModule, "data")
    dm = parser.instantiate_classes(parser.parse_object({"data": config})).data
    assert dm.synthetic == SyntheticTaskSettings(32, 2, 3, 1, 1, 1, 0)
    assert dm.synthetic_val == SyntheticTaskSettings(8, 2, 3, 1, 1, 1, 1000)
