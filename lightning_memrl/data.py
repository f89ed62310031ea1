"""Tasks, a synthetic long-context memory task generator, and the ``MemRLDataModule``.

A task is a question, a context (a list of chunks, or one long text the workflow cuts into
chunks) and gold answers. Files are JSON, JSONL (read by :mod:`lightning_memrl.task_files`) or
Parquet; every row is checked before training and a bad one stops the run with its file, row and field.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_memrl.errors import ConfigError, DataError, check_option
from lightning_memrl.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.splits import check_held_apart, load_locomo_split
from lightning_memrl.task_files import read_json_rows, read_parquet_rows

log = logging.getLogger(__name__)


@dataclass
class Task:
    """One question over a long context."""

    question: str
    context: list[str] | str  # chunks, or one text to cut into chunks of chunk_tokens
    answers: list[str]
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


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
class SyntheticTaskConfig:
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
    """

    num_tasks: int = 64
    min_chunks: int = 2
    max_chunks: int = 3
    sentences_per_chunk: int = 2
    distractor_facts: int = 2
    hops: int = 1
    seed: int = 0


def generate_synthetic_tasks(config: SyntheticTaskConfig) -> list[Task]:
    """Reproducible tasks: secret codes hidden among filler and distractors across chunks."""
    if config.min_chunks < 1 or config.max_chunks < config.min_chunks:
        raise DataError(f"synthetic: need 1 <= min_chunks <= max_chunks, got {config.min_chunks}, {config.max_chunks}")
    for knob in ("num_tasks", "sentences_per_chunk", "distractor_facts"):
        if getattr(config, knob) < 0:
            raise DataError(f"synthetic: {knob} must be >= 0, got {getattr(config, knob)}")
    if config.hops not in (1, 2):
        raise DataError(f"synthetic: hops must be 1 or 2, got {config.hops}")
    if config.distractor_facts + config.hops > len(_NAMES):
        raise DataError(f"synthetic: at most {len(_NAMES) - config.hops} distractor_facts")
    rng = random.Random(config.seed)
    tasks = []
    for index in range(config.num_tasks):
        num_chunks = rng.randint(config.min_chunks, config.max_chunks)
        chunks = [rng.sample(_FILLER, k=min(config.sentences_per_chunk, len(_FILLER))) for _ in range(num_chunks)]
        people = rng.sample(_NAMES, k=config.hops + config.distractor_facts)
        code = f"{rng.randint(1000, 9999)}"
        target = people[0]
        facts = []
        if config.hops == 1:
            facts.append(f"The secret code of {target} is {code}.")
        else:
            facts.append(f"{target} uses the same secret code as {people[1]}.")
            facts.append(f"The secret code of {people[1]} is {code}.")
        for other in people[config.hops :]:
            facts.append(f"The secret code of {other} is {rng.randint(1000, 9999)}.")
        evidence = []
        for i, fact in enumerate(facts):
            chunk = rng.randrange(num_chunks)
            chunks[chunk].insert(rng.randint(0, len(chunks[chunk])), fact)
            if i < config.hops:
                evidence.append(chunk)
        tasks.append(
            Task(
                question=f"What is the secret code of {target}?",
                context=[" ".join(c) for c in chunks],
                answers=[code],
                id=f"synthetic-{config.seed}-{index}",
                meta={"evidence_chunks": sorted(evidence), "num_chunks": num_chunks},
            )
        )
    return tasks


def synthetic_corpus() -> Iterator[str]:
    """Text that covers the synthetic tasks and prompts (trains the tiny test tokenizer)."""
    for hops in (1, 2):
        for task in generate_synthetic_tasks(SyntheticTaskConfig(num_tasks=100, hops=hops, seed=hops)):
            yield task.question
            yield from task.context
    yield "Problem Memory Section Question Answer No previous memory. \\boxed{} Update the memory."
    yield "0123456789 {}[]()<>.,;:!?'\"-_/\\ system user assistant"


# --------------------------------------------------------------------------- files
def _found_instead(row: dict[str, Any]) -> tuple[str, str | None]:
    """What a row without a required field holds instead, and the fix when it is not a column name."""
    wrapped = [k for k, v in row.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    if wrapped:
        return (
            f"; the row is an object whose '{wrapped[0]}' holds a list of {len(row[wrapped[0]])} objects",
            "Write the tasks themselves as the rows: a top-level JSON list ([{...}, {...}]) or one object per "
            "line in a .jsonl file.",
        )
    return f"; the row has fields {sorted(row)[:20]}", None


def _answer_strings(answers: Any) -> tuple[list[str], str]:
    """Gold answers as strings, or ``[]`` and what is wrong; finite numbers count (42 -> "42")."""
    texts = []
    for i, answer in enumerate(answers if isinstance(answers, list) else [answers]):
        got = f"item {i} is" if isinstance(answers, list) else "got"
        if isinstance(answer, bool):
            return [], f'{got} a boolean ({json.dumps(answer)}): write the answer as text, e.g. "yes"'
        if isinstance(answer, float) and not math.isfinite(answer):
            return [], f"{got} {json.dumps(answer)} (not a number, or an empty numeric cell): write the answer as text"
        if isinstance(answer, float):  # a Parquet column mixing ints and floats is read as float: 42.0 -> "42"
            texts.append(str(int(answer)) if answer.is_integer() else str(answer))
        elif isinstance(answer, (str, int)):
            texts.append(str(answer))
        else:
            return [], f"{got} {'null' if answer is None else f'{type(answer).__name__} {answer!r:.40}'}"
    return texts, "" if texts else "got an empty list"


def _check_row(row: Any, index: int, source: str, fields: dict[str, str], line: int | None = None) -> Task:
    """Turn one raw row into a Task or raise an error naming the file, row (and line) and field."""
    where = f"{source}: row {index}" + (f" (line {line})" if line is not None else "")

    def fail(key: str, problem: str, fix: str | None = None) -> DataError:
        fix = fix or f"Fix the row, or map the field with --data.init_args.field_map (e.g. {{'{key}': 'your_column'}})."
        return DataError(f"{where}: field '{fields[key]}' {problem}. {fix}")

    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected an object with fields {[fields[k] for k in ('question', 'context', 'answers')]}, "
            f"got a {type(row).__name__} {row!r:.60}"
        )
    for key in ("question", "context", "answers"):
        if fields[key] not in row:
            raise fail(key, "is missing" + _found_instead(row)[0], _found_instead(row)[1])
        if row[fields[key]] is None:
            raise fail(key, "is missing (null)")
    question, context, answers = (row[fields[k]] for k in ("question", "context", "answers"))
    if not isinstance(question, str) or not question.strip():
        raise fail("question", f"must be a non-empty string, got {type(question).__name__} {question!r:.40}")
    if isinstance(context, str):
        if not context.strip():
            raise fail("context", "is empty")
    elif isinstance(context, list) and context and all(isinstance(c, str) for c in context):
        if not any(c.strip() for c in context):
            raise fail("context", "has only empty chunks")
    else:
        raise fail("context", "must be a string or a non-empty list of strings")
    answers, problem = _answer_strings(answers)
    if problem:
        raise fail("answers", f"must be a string or a non-empty list of strings; {problem}", "Fix the row.")
    if not any(a.strip() for a in answers):
        raise fail("answers", "has only empty answers")
    raw_id = row.get(fields["id"])
    task_id = str(raw_id) if raw_id is not None else f"{Path(source).name}:{index}"
    return Task(question=question, context=context, answers=answers, id=task_id)


def load_tasks(path: str | Path, field_map: dict[str, str] | None = None) -> list[Task]:
    """Read tasks from a JSON, JSONL or Parquet file and check every row.

    A row needs ``question`` (a non-empty string), ``context`` (a string, or a list of chunk
    strings) and ``answers`` (a string or a list of strings; finite numbers are accepted and
    written as text, ``42`` -> ``"42"``, ``2.5`` -> ``"2.5"``; booleans, NaN/Infinity, null and
    nested values are refused); ``id`` is optional. A ``.json`` file holds a list of rows (JSON
    Lines work too); a ``.jsonl`` file one row per line. Both must be UTF-8.

    Args:
        path: the file.
        field_map: maps ``question``/``context``/``answers``/``id`` to the file's column names.

    Raises:
        DataError: unreadable or empty file (naming the line of invalid UTF-8 or JSON), or a row
            with a missing/empty/mistyped field (naming the row, its line and the field).
    """
    path = Path(path)
    fields = {"question": "question", "context": "context", "answers": "answers", "id": "id"}
    unknown = set(field_map or {}) - set(fields)
    if unknown:
        raise DataError(f"field_map: unknown keys {sorted(unknown)}; allowed: {sorted(fields)}")
    fields.update(field_map or {})
    if not path.is_file():
        raise DataError(f"{path}: no such file. Pass an existing JSON, JSONL or Parquet file.")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl", ".parquet"):
        raise DataError(f"{path}: unsupported extension {suffix!r}; use .json, .jsonl or .parquet")
    rows = [] if path.stat().st_size == 0 else read_parquet_rows(path) if suffix == ".parquet" else read_json_rows(path)
    if not rows:
        raise DataError(f"{path}: the file has no rows; it needs at least one task")
    return [_check_row(row, i, str(path), fields, line) for i, (row, line) in enumerate(rows)]


def _collate(tasks: list[Task]) -> list[Task]:
    return tasks


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(size)`` drawn from ``seed + epoch``; Lightning calls ``set_epoch`` each epoch.

    Its iterator saves and restores its epoch and position, so a ``StatefulDataLoader`` resumes
    mid-epoch at the next index, and every later epoch gets the permutation an uninterrupted run
    gets (no generator state is carried from one epoch to the next). A position at the end of an
    epoch is saved as the start of the next: Lightning resumes such a checkpoint into the next epoch
    with the restored iterator, without asking for a new one.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> _EpochShuffleIterator:
        return _EpochShuffleIterator(self.size, self.seed, self.epoch)


class _EpochShuffleIterator(Iterator[int]):
    def __init__(self, size: int, seed: int, epoch: int, yielded: int = 0) -> None:
        import torch

        self.size, self.seed, self.epoch, self.yielded = size, seed, epoch, yielded
        self.order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()

    def __next__(self) -> int:
        if self.yielded >= self.size:
            raise StopIteration
        self.yielded += 1
        return self.order[self.yielded - 1]

    def state_dict(self) -> dict[str, int]:
        if self.yielded >= self.size:  # the epoch is done: resume at the start of the next one
            return {"epoch": self.epoch + 1, "yielded": 0}
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.__init__(self.size, self.seed, state["epoch"], state["yielded"])


class MemRLDataModule(L.LightningDataModule):
    """Training and validation tasks from files or from the synthetic generator.

    Args:
        train_path: JSON/JSONL/Parquet file of training tasks; None uses ``locomo_path``, else ``synthetic``.
        val_path: file of validation tasks; None uses ``locomo_path``, else ``synthetic_val``.
        locomo_path: a LoCoMo JSON file or folder (see ``lightning_memrl.locomo``) used for the
            splits that have no ``train_path``/``val_path``.
        locomo: which LoCoMo questions train (categories, session and question caps, conversation ids).
        locomo_val: which LoCoMo questions validate (default: the same filters as ``locomo``).
        locomo_val_conversations: split ``locomo_path`` by conversation: the last N conversations
            that ``locomo`` keeps (files sorted by name, conversations in file order) validate,
            with ``locomo_val``'s filters, and the others train. 0: no split (choose
            ``locomo.conversations`` and ``locomo_val.conversations`` apart). Needs both splits
            from ``locomo_path`` (unused without it). A fit whose validation tasks repeat training
            tasks is refused.
        field_map: maps ``question``, ``context``, ``answers``, ``id`` to column names.
        synthetic: generator settings of training tasks when ``train_path`` is None.
        synthetic_val: generator settings of validation tasks when ``val_path`` is None (use a
            different seed from training).
        batch_size: tasks per training step (each is rolled out ``group_size`` times).
        val_batch_size: tasks per validation step.
        num_workers: DataLoader workers.
        seed: shuffling seed.
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        field_map: dict[str, str] | None = None,
        locomo_path: str | None = None,
        locomo: LoCoMoSettings | None = None,
        locomo_val: LoCoMoSettings | None = None,
        locomo_val_conversations: int = 0,
        synthetic: SyntheticTaskConfig | None = None,
        synthetic_val: SyntheticTaskConfig | None = None,
        batch_size: int = 2,
        val_batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_option("data.init_args.batch_size", batch_size, 1)
        check_option("data.init_args.val_batch_size", val_batch_size, 1)
        check_option("data.init_args.num_workers", num_workers, 0)
        self.train_path, self.val_path, self.field_map = train_path, val_path, field_map
        self.locomo_path, self.locomo = locomo_path, locomo or LoCoMoSettings()
        self.locomo_val = locomo_val or self.locomo
        if locomo_val_conversations < 0:
            raise ConfigError(f"data.init_args.locomo_val_conversations must be >= 0, got {locomo_val_conversations}")
        if locomo_val_conversations and (train_path or val_path):
            raise ConfigError(
                "data.init_args.locomo_val_conversations splits locomo_path by conversation into both splits: "
                "unset train_path and val_path, or set locomo_val_conversations: 0"
            )
        self.locomo_val_conversations = locomo_val_conversations
        self.synthetic = synthetic or SyntheticTaskConfig()
        self.synthetic_val = synthetic_val or SyntheticTaskConfig(num_tasks=16, seed=self.synthetic.seed + 1000)
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.train_tasks: list[Task] = []
        self.val_tasks: list[Task] = []

    def setup(self, stage: str | None = None) -> None:
        """Load (and check) the tasks once; a fit that validates must validate on other tasks than it trains on."""
        if self.locomo_path and self.locomo_val_conversations and not (self.train_tasks or self.val_tasks):
            self.train_tasks, self.val_tasks = load_locomo_split(
                self.locomo_path, self.locomo, self.locomo_val, self.locomo_val_conversations
            )
        if not self.train_tasks:
            self.train_tasks = (
                load_tasks(self.train_path, self.field_map)
                if self.train_path
                else load_locomo(self.locomo_path, self.locomo)
                if self.locomo_path
                else generate_synthetic_tasks(self.synthetic)
            )
        if not self.val_tasks:
            self.val_tasks = (
                load_tasks(self.val_path, self.field_map)
                if self.val_path
                else load_locomo(self.locomo_path, self.locomo_val)
                if self.locomo_path
                else generate_synthetic_tasks(self.synthetic_val)
            )
        if stage in (None, "fit") and len(self.train_tasks) < self.batch_size:
            raise DataError(
                f"data.batch_size={self.batch_size} but only {len(self.train_tasks)} training tasks: "
                "lower batch_size or add tasks (the last incomplete batch is dropped)"
            )
        validates = self.trainer is None or self.trainer.limit_val_batches != 0
        if stage in (None, "fit") and validates:  # a fit that never validates has no in-sample number
            check_held_apart(self.train_tasks, self.val_tasks)
        log.info("tasks: %d train, %d validation", len(self.train_tasks), len(self.val_tasks))

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled batches from a resumable loader: checkpoints hold its epoch and position in it."""
        import torch

        return StatefulDataLoader(
            self.train_tasks,
            batch_size=self.batch_size,
            sampler=EpochShuffleSampler(len(self.train_tasks), self.seed),
            collate_fn=_collate,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),  # workers' seeds; keeps the global RNG untouched
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_tasks, batch_size=self.val_batch_size, collate_fn=_collate, num_workers=self.num_workers
        )

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
