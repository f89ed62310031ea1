"""A JSON file of memory banks that a model which does not train built greedily, reused across runs.

RMM's prospective reflection runs once per conversation with a fixed model, and on whole LoCoMo
conversations it costs minutes per conversation on a CPU: more than the reranker's whole training. A
fit, each later ``validate`` and every rerun would build the same banks again. :class:`BankCacheFile`
keeps them in one file, each under a key made of what it depends on:

* the *recipe*: the workflow's class, the options and prompts that shape a bank, and the model that
  wrote it (its name or path, dtype and, for a frozen engine, its description, e.g. the adapter it
  switches on; for the policy, a digest of the trained LoRA adapter it runs, e.g. a warm start's);
* the conversation's *fingerprint*: a SHA-256 of its sessions' dates and turns (speaker, text, photo
  caption), so a session cap or an edited file is a different entry.

What the key cannot see is a change of base weights under the same name and dtype (a re-converted
checkpoint), or of a frozen engine's adapter file: delete the file then. A write re-reads the file just
before replacing it atomically, so two processes that build different conversations into one file keep
both unless their writes overlap.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.settings import GenerationSettings


def conversation_fingerprint(conversation: Conversation) -> str:
    """SHA-256 of what a bank is written from: each session's name, date and turns."""
    content = [
        [s.index, s.date_time, [[t.dia_id, t.speaker, t.text, t.caption] for t in s.turns]]
        for s in conversation.sessions
    ]
    return hashlib.sha256(json.dumps(content, ensure_ascii=False).encode()).hexdigest()


def adapter_digest(model: Any) -> str | None:
    """SHA-256 of the active LoRA adapter's weights, or None without one or while it is a no-op (every B = 0).

    A policy loaded with a trained adapter (``lora.adapter_name_or_path``) writes other banks than its base:
    the digest tells them apart. A fresh adapter (B = 0) computes the base model and adds nothing to the key.
    """
    active = getattr(model, "active_adapter", None)
    if not isinstance(active, str) or not hasattr(model, "named_parameters"):
        return None
    weights = sorted(
        ((n, p) for n, p in model.named_parameters() if "lora_" in n and f".{active}." in n), key=lambda w: w[0]
    )
    if not any("lora_B" in n and bool(p.detach().ne(0).any()) for n, p in weights):
        return None
    digest = hashlib.sha256()
    for name, weight in weights:
        digest.update(name.encode())
        digest.update(weight.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_identity(engine: Any) -> dict[str, str]:
    """The model an engine generates with: name or path, dtype, (frozen engines) description and, for the
    policy's engine, the :func:`adapter_digest` of a trained LoRA adapter it runs."""
    model = getattr(engine, "model", None)
    first = next(model.parameters(), None) if model is not None else None
    identity = {
        "name_or_path": str(getattr(model, "name_or_path", "") or ""),
        "dtype": str(first.dtype) if first is not None else "",
        "description": str(getattr(engine, "description", "")),
    }
    adapter = adapter_digest(model) if model is not None and not hasattr(engine, "description") else None
    if adapter is not None:  # only then: keys of banks built by a base model stay what they were
        identity["adapter"] = adapter
    return identity


def bank_recipe(workflow: str, options: dict[str, Any], settings: GenerationSettings, engine: Any) -> dict[str, Any]:
    """What a frozen bank depends on besides its conversation: the ``workflow`` class name, its bank
    ``options``, the greedy generation ``settings`` (less the answer cap) and the model ``engine`` runs."""
    generation = {k: v for k, v in asdict(settings).items() if k not in ("max_new_tokens", "num_generations_eval")}
    return {"workflow": workflow, "options": options, "generation": generation, "model": model_identity(engine)}


class BankCacheFile:
    """Banks stored in a JSON file ``{"banks": {key: {"conversation", "recipe", "build_s", "bank"}}}``.

    Args:
        path: the file (created with its folder on the first :meth:`put`).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @staticmethod
    def key(recipe: dict[str, Any], conversation: Conversation) -> str:
        """The entry's key: SHA-256 of the recipe and the conversation's fingerprint."""
        text = json.dumps({"recipe": recipe, "conversation": conversation_fingerprint(conversation)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _read(self) -> dict[str, Any]:
        if not self.path.is_file():
            return {"banks": {}}
        try:
            data = json.loads(self.path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"bank cache {self.path} is not JSON ({error}); delete it, it is rebuilt on the next run"
            ) from None
        if not isinstance(data, dict) or not isinstance(data.get("banks"), dict):
            raise ValueError(f"bank cache {self.path} has no 'banks' mapping; delete it, it is rebuilt on the next run")
        return data

    def entry(self, recipe: dict[str, Any], conversation: Conversation) -> dict[str, Any] | None:
        """The stored entry of ``conversation`` built by ``recipe`` (``bank``, ``build_s``, ...), or None."""
        return self._read()["banks"].get(self.key(recipe, conversation))

    def get(self, recipe: dict[str, Any], conversation: Conversation) -> dict[str, Any] | None:
        """The stored bank state of ``conversation`` built by ``recipe``, or None."""
        entry = self.entry(recipe, conversation)
        return entry["bank"] if entry is not None else None

    def put(self, recipe: dict[str, Any], built: list[tuple[Conversation, dict[str, Any]]], build_s: float) -> None:
        """Store each (conversation, bank state) of ``built``, which took ``build_s`` seconds together."""
        data = self._read()
        for conversation, state in built:
            data["banks"][self.key(recipe, conversation)] = {
                "conversation": conversation.id,
                "recipe": recipe,
                "build_s": round(build_s / max(len(built), 1), 1),
                "bank": state,
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(data, file)
        os.replace(tmp, self.path)
