"""The memory banks of RMM's offline checks: LoCoMo tasks per conversation, and the banks the base model's
prospective reflection builds from them, cached in a JSON file and rebuilt only for what it lacks.

Used by ``benchmarks/rmm_reranker_offline.py`` (``--banks``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import yaml
from rmm import CONFIG

from lightning_memrl.data.locomo import LoCoMoSettings, load_locomo
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


def build_banks(
    args: argparse.Namespace, workflow: RMMWorkflow, tasks: dict[str, list[Any]], cache: dict[str, Any]
) -> dict[str, Any]:
    """Build the banks of the conversations in ``tasks`` that ``cache`` lacks with the base model's greedy
    reflection, add them to ``cache`` and write it to ``--banks``."""
    from lightning_memrl.models import load_policy, load_tokenizer
    from lightning_memrl.rollout.hf import RolloutEngine
    from lightning_memrl.settings import GenerationSettings

    generation = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["generation"]
    tokenizer = load_tokenizer(args.model)
    engine = RolloutEngine(load_policy(args.model, tokenizer, dtype=args.dtype), tokenizer)
    conversations = [conversation_of(tasks[c][0]) for c in tasks if c not in cache["banks"]]
    start = time.perf_counter()
    with torch.no_grad():
        built = workflow.build_banks(engine, conversations, GenerationSettings(**generation).greedy(), False)
    cache["build_s"] += time.perf_counter() - start
    cache["banks"].update({c.id: bank.state_dict() for c, (bank, _) in zip(conversations, built)})
    args.banks.parent.mkdir(parents=True, exist_ok=True)
    args.banks.write_text(json.dumps(cache, indent=1) + "\n")
    return cache


def bank_recipe(args: argparse.Namespace, workflow: RMMWorkflow) -> dict[str, Any]:
    """What a cached bank depends on: the model, the session cap and the reflection's options and prompts."""
    reflection = ("turns_per_segment", "max_topics", "merge_top_k", "reflect_max_tokens", "merge_max_tokens")
    return {
        "model": args.model,
        "max_sessions": args.max_sessions or None,
        "reflection": {
            **{name: getattr(workflow, name) for name in reflection},
            "reflect_template": workflow.reflect_template,
            "merge_template": workflow.merge_template,
        },
    }


def load_banks(args: argparse.Namespace, workflow: RMMWorkflow, tasks: dict[str, list[Any]]) -> dict[str, Any]:
    """The banks cached in ``--banks`` when they were built the same way, with the missing conversations' added."""
    recipe = bank_recipe(args, workflow)
    cache = {**recipe, "build_s": 0.0, "banks": {}}
    if args.banks.exists():
        cached = json.loads(args.banks.read_text())
        if all(cached.get(k) == v for k, v in recipe.items()):
            cache = cached
        else:
            print(f"{args.banks} was built another way (model, sessions, prompts): rebuilding it")
    if set(tasks) <= set(cache["banks"]):
        return cache
    return build_banks(args, workflow, tasks, cache)
