"""The memory units the retrieval benchmark searches, and the retrievers and rerankers it compares.

Two kinds of units per conversation, each a :class:`~lightning_memrl.memory.bank.MemoryBank` state:

- ``turns``: every dialogue turn is one unit (``speaker: text`` and its photo caption); its source
  turn is itself. No LLM.
- ``reflection``: RMM's prospective-reflection topic memories, built greedily by
  :meth:`RMMWorkflow.build_banks` (the workflow's own code) with the model of the RMM config. A topic
  maps to the turns the model cited in its line (``[D1:3]``); an uncited topic gets every turn of its
  segment, and a merge adds the merged topic's turns to the entry it merged into.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.memory.bank import MemoryBank, MemoryEntry
from lightning_memrl.memory.embedders import Embedder, HashingEmbedder, SentenceTransformerEmbedder
from lightning_memrl.workflows.rmm import Reranker, RMMWorkflow, gumbel_top_m

RERANKER_PREFIX = "workflow_modules.reranker."  # where MemRLModule keeps the reranker in a checkpoint


def turn_units(conversation: Conversation) -> dict[str, Any]:
    """A bank state with one entry per dialogue turn, mapped to that turn."""
    bank = MemoryBank()
    for session in conversation.sessions:
        for turn in session.turns:
            photo = f" [shares a photo: {turn.caption}]" if turn.caption else ""
            bank.add(f"{turn.speaker}: {turn.text}{photo}", session.name, session.date_time, [turn.dia_id])
    return bank.state_dict()


def reflection_units(
    workflow_args: dict[str, Any], model: str, conversations: list[Conversation], cache: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """RMM's reflection bank state per conversation id, built once and cached in ``cache`` (a JSON file).

    Returns the states and facts about the build (model, seconds, the workflow's counters).
    """
    saved = json.loads(cache.read_text()) if cache.is_file() else {"banks": {}, "builds": []}
    states: dict[str, dict[str, Any]] = saved["banks"]
    missing = [c for c in conversations if c.id not in states]
    if missing:
        from transformers import AutoModelForCausalLM

        from lightning_memrl.model_paths import resolve_model_path
        from lightning_memrl.models import load_tokenizer
        from lightning_memrl.rollout.hf import RolloutEngine
        from lightning_memrl.settings import GenerationSettings

        path = resolve_model_path(model)
        policy = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        workflow = RMMWorkflow(**{**workflow_args, "train_generator": False, "judge": None})
        start = time.perf_counter()
        with torch.no_grad():
            built = workflow.build_banks(
                RolloutEngine(policy, load_tokenizer(path)), missing, GenerationSettings(temperature=0.0), False
            )
        seconds = round(time.perf_counter() - start, 1)
        saved["builds"].append({"conversations": [c.id for c in missing], "seconds": seconds, **workflow.counters})
        states.update({c.id: bank.state_dict() for c, (bank, _) in zip(missing, built)})
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(saved))
    facts = {"model": model, "cache": cache.name, "builds": saved["builds"]}  # builds: seconds and counters
    return {c.id: states[c.id] for c in conversations}, facts


def make_embedder(name: str, dim: int) -> Embedder:
    """``hashing`` (:class:`HashingEmbedder` of ``dim``) or ``minilm`` (the offline all-MiniLM-L6-v2)."""
    return HashingEmbedder(dim) if name == "hashing" else SentenceTransformerEmbedder()


def bank_of(state: dict[str, Any], retriever: str, embedder: Embedder | None) -> MemoryBank:
    """A bank over the units of ``state``: ``bm25``, or ``dense`` with ``embedder``."""
    bank = MemoryBank(retriever, embedder)
    bank.load_state_dict(state)
    return bank


def load_reranker(ckpt: str | Path, dim: int) -> Reranker:
    """The RMM reranker a training checkpoint holds (its adapters must be ``dim`` wide).

    Raises:
        SystemExit: the file has no reranker weights, or their size does not match the embedder.
    """
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved = state.get("state_dict", {})
    weights = {k[len(RERANKER_PREFIX) :]: v for k, v in saved.items() if k.startswith(RERANKER_PREFIX)}
    if not weights:
        raise SystemExit(f"--ckpt {ckpt}: no {RERANKER_PREFIX}* weights; give a checkpoint of an RMM fit")
    size = weights["query_adapter.weight"].shape[0]
    if size != dim:
        raise SystemExit(
            f"--ckpt {ckpt}: the reranker is {size} wide but --rerank-embedding gives {dim}-dim vectors; "
            "use the embedding the fit used (RMMWorkflow embedding/embedding_dim)"
        )
    reranker = Reranker(dim)
    reranker.load_state_dict(weights)
    return reranker.eval()


def reranked(
    first_stage: MemoryBank, top_k: int, reranker: Reranker, embedder: Embedder, temperature: float
) -> Callable[[str, int], list[MemoryEntry]]:
    """A retrieval function: the first stage's ``top_k`` for a question, ordered by ``reranker`` as RMM's
    evaluation orders them (the best first, no Gumbel noise); memory vectors embedded once per entry."""
    vectors: dict[str, torch.Tensor] = {}

    def retrieve(question: str, k: int) -> list[MemoryEntry]:
        candidates = [e for e, _ in first_stage.retrieve(question, top_k)]
        if not candidates:
            return []
        new = [e for e in candidates if e.id not in vectors]
        if new:
            vectors.update(zip([e.id for e in new], embedder.embed([e.text for e in new])))
        with torch.no_grad():
            scores = reranker(embedder.embed([question])[0], torch.stack([vectors[e.id] for e in candidates]))
        chosen = gumbel_top_m(scores, k, temperature, noise=False)
        return [candidates[i] for i in chosen.tolist()]

    return retrieve


def plain(bank: MemoryBank) -> Callable[[str, int], list[MemoryEntry]]:
    """A retrieval function over ``bank``'s own ranking."""
    return lambda question, k: [e for e, _ in bank.retrieve(question, k)]
