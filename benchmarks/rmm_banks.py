"""The memory banks of RMM's offline checks: LoCoMo tasks per conversation, and the banks the base model's
prospective reflection builds from them, kept in the workflow's bank cache file (the same file a
``lightning-memrl`` run reads with ``workflow.init_args.bank_cache``), built only where it lacks them.

Used by ``benchmarks/rmm_reranker_offline.py`` (``--banks``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import yaml
from rmm import CONFIG

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
from lightning_memrl.memory.bank_cache import BankCacheFile
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.workflows.bank import conversation_of
from lightning_memrl.workflows.rmm import RMMWorkflow


def load_tasks(args: argparse.Namespace) -> dict[str, list[Any]]:
    """The tasks of each conversation in ``--conversations`` and ``--held_apart`` under the caps."""
    settings = LoCoMoSettings(
        max_sessions=args.max_sessions or None, max_questions=args.max_questions or None, conversations=None
    )
    tasks: dict[str, list[Any]] = {}
    for conversation in [*args.conversations, *([args.held_apart] if args.held_apart else [])]:
        settings.conversations = [conversation]
        tasks[conversation] = load_locomo(args.locomo, settings)
        if not tasks[conversation]:
            raise SystemExit(
                f"{conversation}: no question of {args.locomo} kept under --max_sessions / --max_questions"
            )
    return tasks


def reflection_engine(args: argparse.Namespace) -> Any:
    """A rollout engine over ``--model`` (``--dtype``): the base model that reflects."""
    from lightning_memrl.models import load_policy, load_tokenizer
    from lightning_memrl.rollout.hf import RolloutEngine

    tokenizer = load_tokenizer(args.model)
    return RolloutEngine(load_policy(args.model, tokenizer, dtype=args.dtype), tokenizer)


def reflection_settings() -> GenerationSettings:
    """The greedy generation settings of ``configs/rmm/locomo.yaml`` (those of a ``lightning-memrl`` run)."""
    return GenerationSettings(**yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["generation"]).greedy()


def bank_recipe(args: argparse.Namespace, workflow: RMMWorkflow, engine: Any = None) -> dict[str, Any]:
    """What a bank in ``--banks`` was built by (the workflow's ``bank_cache`` recipe for ``--model``)."""
    return workflow.bank_recipe(engine or reflection_engine(args), reflection_settings())


def load_banks(args: argparse.Namespace, workflow: RMMWorkflow, tasks: dict[str, list[Any]]) -> dict[str, Any]:
    """The banks of ``tasks``' conversations, as ``lightning-memrl`` runs get them with ``workflow.bank_cache:
    --banks``: read from the file when built the same way (model, options, conversation), else built by the
    base model's greedy reflection and added to it. Also the seconds their building took (``build_s``)."""
    engine = reflection_engine(args)
    workflow.bank_cache = cache = BankCacheFile(args.banks)
    conversations = [conversation_of(tasks[c][0]) for c in tasks]
    with torch.no_grad():
        banks = workflow.build_greedy_banks(engine, conversations, reflection_settings(), from_file=True)
    recipe = bank_recipe(args, workflow, engine)
    return {
        "model": args.model,
        "build_s": sum(cache.entry(recipe, c)["build_s"] for c in conversations),
        "banks": {c.id: bank.state_dict() for c, bank in zip(conversations, banks)},
    }
