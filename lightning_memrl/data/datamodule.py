"""``MemRLDataModule``: the Lightning datamodule that serves training and validation tasks.

Each split comes from the first source it is given: a task file (:mod:`lightning_memrl.data.files`),
LoCoMo conversations (:mod:`lightning_memrl.data.locomo`, optionally split by conversation with
:mod:`lightning_memrl.data.splits`), or the synthetic generator (:mod:`lightning_memrl.data.synthetic`).
Training batches come from a resumable loader whose :class:`EpochShuffleSampler` saves its epoch and
position in checkpoints; a fit whose validation tasks repeat training tasks is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_memrl.data.files import load_tasks
from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.data.splits import check_held_apart, load_locomo_split
from lightning_memrl.data.synthetic import SyntheticTaskSettings, generate_synthetic_tasks
from lightning_memrl.errors import ConfigError, DataError, check_option
from lightning_memrl.types import Task

log = logging.getLogger(__name__)


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
        predict_path: file of documents that ``lightning-memrl predict`` runs the agent on: rows of
            ``question`` and ``context`` (``answers`` optional; when given, the predictions are scored).
        locomo_path: a LoCoMo JSON file or folder (see ``lightning_memrl.data.locomo``) used for the
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
        predict_path: str | None = None,
        field_map: dict[str, str] | None = None,
        locomo_path: str | None = None,
        locomo: LoCoMoSettings | None = None,
        locomo_val: LoCoMoSettings | None = None,
        locomo_val_conversations: int = 0,
        synthetic: SyntheticTaskSettings | None = None,
        synthetic_val: SyntheticTaskSettings | None = None,
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
        self.predict_path = predict_path
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
        self.synthetic = synthetic or SyntheticTaskSettings()
        self.synthetic_val = synthetic_val or SyntheticTaskSettings(num_tasks=16, seed=self.synthetic.seed + 1000)
        self.batch_size, self.val_batch_size = batch_size, val_batch_size
        self.num_workers, self.seed = num_workers, seed
        self.train_tasks: list[Task] = []
        self.val_tasks: list[Task] = []
        self.predict_tasks: list[Task] = []

    def setup(self, stage: str | None = None) -> None:
        """Load (and check) the tasks once; a fit that validates must validate on other tasks than it trains on.

        ``predict`` loads ``predict_path`` only.
        """
        if stage == "predict":
            self.predict_tasks = self.predict_tasks or self._load_predict()
            return
        if self.locomo_path and self.locomo_val_conversations and not (self.train_tasks or self.val_tasks):
            self.train_tasks, self.val_tasks = load_locomo_split(
                self.locomo_path, self.locomo, self.locomo_val, self.locomo_val_conversations
            )
        if not self.train_tasks:
            self.train_tasks = self._load_split(self.train_path, self.locomo, self.synthetic)
        if not self.val_tasks:
            self.val_tasks = self._load_split(self.val_path, self.locomo_val, self.synthetic_val)
        if stage in (None, "fit") and len(self.train_tasks) < self.batch_size:
            raise DataError(
                f"data.batch_size={self.batch_size} but only {len(self.train_tasks)} training tasks: "
                "lower batch_size or add tasks (the last incomplete batch is dropped)"
            )
        validates = self.trainer is None or self.trainer.limit_val_batches != 0
        if stage in (None, "fit") and validates:  # a fit that never validates has no in-sample number
            check_held_apart(self.train_tasks, self.val_tasks)
        log.info("tasks: %d train, %d validation", len(self.train_tasks), len(self.val_tasks))

    def _load_split(self, path: str | None, locomo: LoCoMoSettings, synthetic: SyntheticTaskSettings) -> list[Task]:
        """One split's tasks: from ``path`` when set, else from ``locomo_path`` with ``locomo``, else generated."""
        if path:
            return load_tasks(path, self.field_map)
        if self.locomo_path:
            return load_locomo(self.locomo_path, locomo)
        return generate_synthetic_tasks(synthetic)

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled batches from a resumable loader: checkpoints hold its epoch and position in it."""
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

    def _load_predict(self) -> list[Task]:
        if not self.predict_path:
            raise ConfigError(
                "lightning-memrl predict needs --data.init_args.predict_path FILE: a JSON, JSONL or Parquet file "
                "of rows with question and context (answers optional)"
            )
        tasks = load_tasks(self.predict_path, self.field_map, require_answers=False)
        log.info("tasks: %d to predict from %s", len(tasks), self.predict_path)
        return tasks

    def predict_dataloader(self) -> DataLoader:
        """``predict_path``'s documents in file order, ``val_batch_size`` at a time."""
        return DataLoader(
            self.predict_tasks, batch_size=self.val_batch_size, collate_fn=_collate, num_workers=self.num_workers
        )
