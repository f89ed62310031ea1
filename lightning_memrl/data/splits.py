"""Held-apart validation: LoCoMo split by conversation, and a check that no task is in both splits.

A validation number measured on training tasks is in-sample. ``MemRLDataModule`` refuses a fit
whose validation tasks repeat training tasks (same question over the same context, whatever the
source: files, the synthetic generator, LoCoMo), and can split LoCoMo by conversation: the last
``n`` conversations validate, the others train, so no conversation's bank is built from training
data and then scored.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.errors import DataError
from lightning_memrl.types import Task

log = logging.getLogger(__name__)


SHOWN = 5  # overlapping ids named in an error message


def load_locomo_split(
    path: str | Path, train: LoCoMoSettings, val: LoCoMoSettings, val_conversations: int
) -> tuple[list[Task], list[Task]]:
    """Training and validation tasks of ``path``, split by conversation.

    The conversations that ``train`` keeps are taken in the order they are read (files sorted by
    name, conversations in file order); the last ``val_conversations`` of them validate (with the
    ``val`` filters: categories, sessions, question cap) and the others train.

    Raises:
        DataError: fewer than ``val_conversations + 1`` conversations, or ``val.conversations`` set too.
    """
    if val.conversations is not None:
        raise DataError(
            "data.init_args.locomo_val.conversations and data.init_args.locomo_val_conversations both choose the "
            "validation conversations; set one (locomo_val_conversations: 0 to use the list)"
        )
    pool = load_locomo(path, train)
    order = list(dict.fromkeys(t.meta["conversation_id"] for t in pool))
    if len(order) <= val_conversations:
        raise DataError(
            f"{path}: data.init_args.locomo_val_conversations={val_conversations} needs at least "
            f"{val_conversations + 1} conversations with training questions, locomo keeps {len(order)} {order}: "
            "add conversations, lower it, or set it to 0 and give validation other tasks (val_path, or "
            "locomo.conversations and locomo_val.conversations apart)"
        )
    train_ids, val_ids = order[:-val_conversations], order[-val_conversations:]
    train_tasks = [t for t in pool if t.meta["conversation_id"] in set(train_ids)]
    val_tasks = load_locomo(path, replace(val, conversations=val_ids))
    rank_zero_info(  # shown on the console like Lightning's own messages
        f"LoCoMo split by conversation: train on {len(train_ids)} conversations {train_ids} ({len(train_tasks)} "
        f"questions), validate on {len(val_ids)} {val_ids} ({len(val_tasks)} questions)"
    )
    return train_tasks, val_tasks


def _key(task: Task) -> tuple[str, tuple[Any, ...]]:
    context = task.context if isinstance(task.context, list) else [task.context]
    return task.question.strip(), tuple(context)


def check_held_apart(train: list[Task], val: list[Task]) -> None:
    """Stop when a validation task is also a training task (same question over the same context).

    Tasks of LoCoMo conversations that both splits use, with different questions, are allowed and
    logged as a warning (validation is then held apart by question only).

    Raises:
        DataError: naming the count and the first overlapping ids.
    """
    train_ids = {_key(t): t.id for t in train}
    both = [(train_ids[_key(v)], v.id) for v in val if _key(v) in train_ids]
    if both:
        shown = ", ".join(repr(a) if a == b else f"{a!r} (validation {b!r})" for a, b in both[:SHOWN])
        raise DataError(
            f"train and validation tasks overlap: {len(both)} of {len(val)} validation tasks are training tasks "
            f"(same question and context), e.g. {shown}; a validation score on them is in-sample. Validate on "
            "other tasks: val_path, another synthetic_val.seed, or for LoCoMo data.init_args.locomo_val_conversations "
            "(the last N conversations validate, the rest train)"
        )
    conversations = {t.meta.get("conversation_id") for t in train} & {t.meta.get("conversation_id") for t in val}
    conversations.discard(None)
    if conversations:
        log.warning(
            "train and validation use different questions of the same %d LoCoMo conversations %s: validation is "
            "held apart by question, not by conversation (see data.init_args.locomo_val_conversations)",
            len(conversations),
            sorted(conversations),
        )
