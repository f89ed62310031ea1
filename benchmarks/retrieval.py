"""Retrieval on LoCoMo: how often RMM's retrieval finds a question's evidence turns, per retriever.

For every question with evidence (categories 1-4) of the held-apart conversation(s) of the RMM
config's split (the last ``locomo_val_conversations`` of them; or ``--conversations``), each
retriever returns its top k memory units, and Recall@k is the share of the question's evidence
``dia_id``\\ s among the source turns of those units (``evaluation.metrics.evidence_recall``, the
metric of validation's ``evidence_recall``), averaged over questions, overall and by category.
``turns@k`` is how many distinct turns the top k cite: a unit citing many turns buys recall with it.

Retrievers: ``bm25`` (the project's ``MemoryBank`` BM25, ``bm25s`` with English stop words),
``dense`` (all-MiniLM-L6-v2 cosine), ``hashing`` (the weight-free ``HashingEmbedder``, the default
when no dense model), ``rerank-identity`` (RMM's ``Reranker`` at its untrained, identity start) and
``rerank-trained`` (the reranker of ``--ckpt``), both over the ``--first-stage`` top ``--top-k`` and
ordering them as RMM's evaluation does. Units (see ``retrieval_units``): ``turns`` (raw dialogue
turns, no LLM) or ``reflection`` (RMM's topic memories, built by the workflow with the config's model).

    python benchmarks/retrieval.py --locomo PATH                       # turns, every session
    python benchmarks/retrieval.py --locomo PATH --units reflection turns --max-sessions 2 --ckpt last.ckpt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import RESULTS, machine, markdown_table, set_threads  # noqa: E402
from retrieval_units import (  # noqa: E402
    bank_of,
    load_reranker,
    make_embedder,
    plain,
    reflection_units,
    reranked,
    turn_units,
)

from lightning_memrl.data.locomo import Conversation, LoCoMoSettings, load_locomo  # noqa: E402
from lightning_memrl.data.splits import load_locomo_split  # noqa: E402
from lightning_memrl.evaluation.metrics import evidence_recall  # noqa: E402
from lightning_memrl.memory.bank import MemoryBank  # noqa: E402
from lightning_memrl.types import Task  # noqa: E402
from lightning_memrl.workflows.rmm import Reranker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RETRIEVERS = ("bm25", "dense", "hashing", "rerank-identity", "rerank-trained")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--locomo", required=True, help="LoCoMo JSON file or folder")
    p.add_argument("--config", default=str(ROOT / "configs/rmm/locomo.yaml"), help="RMM config (split, workflow)")
    p.add_argument("--conversations", nargs="+", default=None, help="conversation ids (default: held-apart ones)")
    p.add_argument("--max-sessions", type=int, default=None, help="read the first N sessions (default: all)")
    p.add_argument("--units", nargs="+", default=["turns"], choices=["turns", "reflection"], help="memory units")
    p.add_argument("--retrievers", nargs="+", default=None, choices=RETRIEVERS, help="default: all (trained: --ckpt)")
    p.add_argument("--first-stage", default="dense", choices=["bm25", "dense", "hashing"], help="rerankers' top-K")
    p.add_argument("--top-k", type=int, default=20, help="first-stage candidates the rerankers order (RMM's K)")
    p.add_argument("--k", type=int, nargs="+", default=[5, 10], help="Recall@k cut-offs")
    p.add_argument("--rerank-embedding", default=None, choices=["hashing", "minilm"], help="default: the config's")
    p.add_argument("--ckpt", default=None, help="checkpoint of an RMM fit: its reranker is rerank-trained")
    p.add_argument("--model", default=None, help="reflection model (default: the config's)")
    p.add_argument("--bank-cache", default=None, help="reflection banks JSON (default under logs/bench_retrieval)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/retrieval_locomo_*.json)")
    args = p.parse_args(argv)
    args.retrievers = args.retrievers or [r for r in RETRIEVERS if r != "rerank-trained" or args.ckpt]
    if "rerank-trained" in args.retrievers and not args.ckpt:
        p.error("--retrievers rerank-trained needs --ckpt")
    if max(args.k) > args.top_k:
        p.error(f"--k {max(args.k)} is above --top-k {args.top_k}: the rerankers only order the top-K")
    return args


def read_config(path: str) -> dict[str, Any]:
    """The RMM config's workflow options, model, and data block (``data:`` may name a file)."""
    config = yaml.safe_load(Path(path).read_text())
    data = config["data"]
    if isinstance(data, str):
        data = yaml.safe_load((Path(path).parent / data).read_text())
    model = config["model"]["init_args"]
    workflow = dict(model["workflow"]["init_args"])
    return {"workflow": workflow, "model": model["model_name_or_path"], "data": data["init_args"]}


def load_tasks(args: argparse.Namespace, data: dict[str, Any]) -> list[Task]:
    """Every category 1-4 question of ``--conversations``, else of the config split's held-apart conversations."""
    settings = LoCoMoSettings(max_sessions=args.max_sessions, conversations=args.conversations)
    if args.conversations:
        return load_locomo(args.locomo, settings)
    train = LoCoMoSettings(**data["locomo"])  # decides the split's order, as the fit does
    return load_locomo_split(args.locomo, train, settings, int(data["locomo_val_conversations"]))[1]


def recall_rows(tasks: list[Task], retrieve: Callable[[str, int], list[Any]], ks: list[int]) -> list[dict[str, Any]]:
    """Per question with evidence: its category, Recall@k and distinct turns cited for every ``k``."""
    rows = []
    for task in tasks:
        evidence = task.meta["evidence"]
        top = retrieve(task.question, max(ks))
        row: dict[str, Any] = {"category": task.meta["category"]}
        for k in ks:
            sources = {s for e in top[:k] for s in e.source_ids}
            row[f"recall@{k}"] = evidence_recall(sources, evidence)
            row[f"turns@{k}"] = len(sources)
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    """Means over all questions and by category."""

    def means(group: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"questions": len(group)}
        for k in ks:
            for name in (f"recall@{k}", f"turns@{k}"):
                out[name] = sum(r[name] for r in group) / len(group) if group else float("nan")
        return out

    by_category: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_category[row["category"]].append(row)
    return {"all": means(rows), "by_category": {str(c): means(g) for c, g in sorted(by_category.items())}}


def retrievers_for(
    state: dict[str, Any], args: argparse.Namespace, embedders: dict[str, Any], rerankers: dict[str, Reranker]
) -> dict[str, Callable[[str, int], list[Any]]]:
    """The retrieval functions of ``args.retrievers`` over one conversation's units (each index built once)."""
    kinds = {"bm25": ("bm25", None), "dense": ("dense", "minilm"), "hashing": ("dense", "hashing")}
    made: dict[str, MemoryBank] = {}

    def bank(name: str) -> MemoryBank:
        if name not in made:
            retriever, embedder = kinds[name]
            made[name] = bank_of(state, retriever, embedders[embedder] if embedder else None)
        return made[name]

    temperature = float(args.workflow.get("temperature", 0.5))
    out: dict[str, Callable[[str, int], list[Any]]] = {}
    for name in args.retrievers:
        if name in kinds:
            out[name] = plain(bank(name))
        else:
            embedder = embedders[args.rerank_embedding]
            out[name] = reranked(bank(args.first_stage), args.top_k, rerankers[name], embedder, temperature)
    return out


def evaluate(
    tasks: list[Task], units: dict[str, dict[str, Any]], args: argparse.Namespace, embedders: dict[str, Any]
) -> dict[str, Any]:
    """Summaries per retriever over every conversation's units, with the seconds each took."""
    dim = embedders[args.rerank_embedding].dim
    rerankers = {"rerank-identity": Reranker(dim).eval()}
    if args.ckpt:
        rerankers["rerank-trained"] = load_reranker(args.ckpt, dim)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    seconds: dict[str, float] = defaultdict(float)
    for conversation_id, state in units.items():
        mine = [t for t in tasks if t.meta["conversation_id"] == conversation_id and t.meta["evidence"]]
        for name, retrieve in retrievers_for(state, args, embedders, rerankers).items():
            start = time.perf_counter()
            rows[name] += recall_rows(mine, retrieve, args.k)
            seconds[name] += time.perf_counter() - start
    return {name: {**summarize(rows[name], args.k), "seconds": round(seconds[name], 1)} for name in args.retrievers}


def build_units(kind: str, conversations: list[Conversation], args: argparse.Namespace) -> tuple[dict, dict]:
    """Bank states per conversation id of one unit kind, and facts about them."""
    if kind == "turns":
        states = {c.id: turn_units(c) for c in conversations}
        facts: dict[str, Any] = {"what": "one unit per dialogue turn (speaker: text, photo caption); no LLM"}
    else:
        tag = f"{Path(args.model).name}_s{args.max_sessions or 'all'}"
        cache = Path(args.bank_cache or ROOT / f"logs/bench_retrieval/reflection_{tag}.json")
        states, facts = reflection_units(args.workflow, args.model, conversations, cache)
        facts["what"] = "RMM prospective-reflection topic memories (RMMWorkflow.build_banks, greedy)"
    counts = [len(s["entries"]) for s in states.values()]
    sources = [len(e["source_ids"]) for s in states.values() for e in s["entries"]]
    facts.update(units=sum(counts), mean_turns_per_unit=sum(sources) / max(len(sources), 1))
    return states, facts


def needed_embedders(args: argparse.Namespace) -> dict[str, Any]:
    """The embedders the chosen retrievers use (all-MiniLM-L6-v2 is loaded only when one needs it)."""
    reranking = any(r.startswith("rerank") for r in args.retrievers)
    names = {"hashing"}
    if "dense" in args.retrievers or (reranking and args.first_stage == "dense") or args.rerank_embedding == "minilm":
        names.add("minilm")
    return {name: make_embedder(name, args.hashing_dim) for name in sorted(names)}


def table(results: dict[str, dict[str, Any]], ks: list[int]) -> str:
    """Markdown: one row per units x retriever, Recall@k and turns@k overall, then Recall@k per category."""
    categories = sorted({c for units in results.values() for r in units.values() for c in r["by_category"]})
    headers = ["units", "retriever", "questions", *[f"R@{k}" for k in ks], *[f"turns@{k}" for k in ks]]
    headers += [f"R@{ks[0]} cat {c}" for c in categories]
    rows = []
    for units, by_retriever in results.items():
        for name, result in by_retriever.items():
            overall = result["all"]
            row = [units, name, overall["questions"], *[overall[f"recall@{k}"] for k in ks]]
            row += [overall[f"turns@{k}"] for k in ks]
            row += [result["by_category"].get(c, {}).get(f"recall@{ks[0]}", float("nan")) for c in categories]
            rows.append(row)
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    set_threads(args.threads)
    config = read_config(args.config)
    args.workflow, args.model = config["workflow"], args.model or config["model"]
    embedding = config["workflow"].get("embedding", "hashing")
    args.rerank_embedding = args.rerank_embedding or ("minilm" if embedding == "sentence-transformers" else "hashing")
    args.hashing_dim = int(config["workflow"].get("embedding_dim", 256))
    tasks = load_tasks(args, config["data"])
    conversations = list({t.meta["conversation_id"]: t.meta["conversation"] for t in tasks}.values())
    no_evidence = sum(not t.meta["evidence"] for t in tasks)
    embedders = needed_embedders(args)
    results, units_facts = {}, {}
    for kind in args.units:
        states, units_facts[kind] = build_units(kind, conversations, args)
        results[kind] = evaluate(tasks, states, args, embedders)
    ids = [c.id for c in conversations]
    result = {
        "what": "Recall@k of LoCoMo evidence turns: share of a question's evidence dia_ids among the source "
        "turns of the top-k retrieved units (a turn unit's source is itself; a reflection topic's are the "
        "turns it cites, all its segment's when it cites none)",
        "locomo": Path(args.locomo).name,  # the data folder or file, by name
        "conversations": ids,
        "max_sessions": args.max_sessions,
        "questions": len(tasks),
        "questions_without_evidence_skipped": no_evidence,
        "first_stage": args.first_stage,
        "top_k": args.top_k,
        "rerank_embedding": "minilm" if args.rerank_embedding == "minilm" else f"hashing-{args.hashing_dim}",
        "ckpt": args.ckpt,
        "units": units_facts,
        "results": results,
        "machine": machine(args.threads),
    }
    name = f"retrieval_locomo_{'+'.join(args.units)}_{'+'.join(ids)}_s{args.max_sessions or 'all'}"
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(tasks) - no_evidence} questions with evidence ({no_evidence} without, skipped) of {ids}")
    print(table(results, args.k))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
