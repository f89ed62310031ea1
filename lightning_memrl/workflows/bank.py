"""What Memory-R1 and RMM share: LoCoMo conversations cut into segments, memory banks, frozen parts.

Both paradigms first turn a conversation into a :class:`~lightning_memrl.memory.bank.MemoryBank`
(Memory-R1: extract facts, then one ADD/UPDATE/DELETE/NOOP per fact; RMM: summarise topics, then
add or merge each), then answer a question from retrieved entries.

An agent that is not trained in the current stage (a *frozen* agent) generates with
``frozen_engine``: a fixed model that ``MemRLModule`` provides (the LoRA base with adapters
disabled, else a frozen copy of the initial weights), never with the policy being trained, so it
behaves the same at every step. Its results (facts, reflection banks) are built greedily, once per
conversation, cached, and logged with the model that built them. An agent that trains uses the
policy; its greedy results (validation banks) are cached only until the next training rollout,
which precedes an optimizer step and so makes them stale.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from lightning_memrl.data.locomo import Conversation, DialogTurn, Session
from lightning_memrl.errors import DataError, check_placeholders
from lightning_memrl.evaluation.judge import LLMJudge
from lightning_memrl.evaluation.metrics import evidence_recall
from lightning_memrl.memory.bank import MemoryBank, MemoryEntry
from lightning_memrl.memory.bank_cache import BankCacheFile, bank_recipe
from lightning_memrl.memory.embedders import Embedder, build_embedder
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.rollout.frozen import engine_description
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import ANSWER_TURN, Task, Trajectory, Turn
from lightning_memrl.workflows.base import Workflow, encode_chat_prompt

log = logging.getLogger(__name__)

_TAG = re.compile(r"\[?\bD:?(\d+):(\d+)\]?")
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s*")


@dataclass
class Segment:
    """Consecutive turns of one session: the unit a memory-writing call reads."""

    session: Session
    turns: list[DialogTurn]

    @property
    def text(self) -> str:
        return self.session.render(self.turns)

    @property
    def source_ids(self) -> list[str]:
        return [t.dia_id for t in self.turns]


def split_segments(conversation: Conversation, turns_per_segment: int = 0) -> list[Segment]:
    """Sessions in order, each cut into runs of ``turns_per_segment`` turns (0: whole sessions)."""
    out = []
    for session in conversation.sessions:
        step = turns_per_segment if turns_per_segment > 0 else max(len(session.turns), 1)
        for start in range(0, len(session.turns), step):
            out.append(Segment(session, session.turns[start : start + step]))
    return out


def _normalized(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def parse_items(
    text: str,
    segment_ids: list[str],
    max_items: int,
    counts: Counter[str] | None = None,
    instructions: str = "",
) -> list[tuple[str, list[str]]]:
    """Lines of a model's list (bullets and numbers stripped) with the dia_ids they cite.

    A line citing ids of the segment (``[D1:3]``) keeps those as its sources; otherwise it gets
    every id of the segment (counted as ``uncited`` in ``counts``). Empty lines, headers ending in
    ``:`` and "none" are skipped, and so is a line that repeats ``instructions`` (the prompt's own
    words, e.g. its example line: small models copy it), counted as ``copied``.
    """
    prompt_words = _normalized(instructions)
    items = []
    for line in text.splitlines():
        line = _BULLET.sub("", line).strip()
        cited = [f"D{a}:{b}" for a, b in _TAG.findall(line)]
        line = " ".join(_TAG.sub(" ", line).split())
        if line.endswith(":"):  # a header such as "Facts:"
            continue
        line = line.strip(" -:")
        if not line or line.lower() in ("none", "no facts", "n/a") or len(line) < 3:
            continue
        words = _normalized(line)
        if prompt_words and len(words.split()) >= 3 and f" {words} " in f" {prompt_words} ":
            if counts is not None:
                counts["copied"] += 1
            continue
        known = [c for c in cited if c in segment_ids]
        if not known and counts is not None:
            counts["uncited"] += 1
        items.append((line, known or list(segment_ids)))
        if len(items) >= max_items:
            break
    return items


def conversation_of(task: Task) -> Conversation:
    """The :class:`Conversation` a LoCoMo task carries, or a clear error for other tasks."""
    conversation = task.meta.get("conversation")
    if not isinstance(conversation, Conversation):
        raise DataError(
            f"task {task.id!r} has no LoCoMo conversation: memory-bank workflows need LoCoMo data "
            "(set --data.init_args.locomo_path)"
        )
    return conversation


def record_shown(trajectory: Trajectory, shown: list[MemoryEntry]) -> None:
    """Note in ``trajectory.info`` the ids of the entries shown to its answerer and the dialogue turns they cite."""
    trajectory.info["shown_ids"] = [e.id for e in shown]
    trajectory.info["shown_source_ids"] = sorted({s for e in shown for s in e.source_ids})


class BankWorkflow(Workflow):
    """Base of workflows that build a memory bank per conversation and answer from it.

    Subclasses implement :meth:`build_banks` (write the bank), :meth:`show_memories` (what the
    answerer sees) and :meth:`answer_is_trained`, and may override :meth:`read_answer`.

    Args:
        answer_template: prompt of the answer turn, with ``{memories}``, ``{question}``,
            ``{speaker_a}``, ``{speaker_b}``.
        retriever: ``bm25`` or ``dense`` retrieval of the banks (``dense``: cosine similarity of the
            ``embedding`` vectors).
        embedding: ``hashing`` (offline, no weights) or ``sentence-transformers`` (the ``dense`` extra):
            the vectors of ``dense`` retrieval (and of RMM's reranker).
        embedding_dim: size of ``hashing`` embeddings.
        embedding_model: sentence-transformers model path (None: the bundled all-MiniLM-L6-v2).
        turns_per_segment: dialogue turns per memory-writing call (0: a whole session).
        max_batch: most prompts per ``generate`` call.
        system_prompt: optional system message of every turn.
        judge: optional LLM judge scoring validation answers (``judge`` in the report).
        bank_cache: a JSON file that keeps the banks a model which does not train builds, across runs
            (:class:`~lightning_memrl.memory.bank_cache.BankCacheFile`; keyed by the model, the options that
            shape a bank and the conversation's content). None: banks live in memory and in checkpoints only.
            Only workflows whose ``caches_banks_to_file`` is true take it (RMM).
    """

    caches_banks_to_file = False  # True where a bank depends only on bank_options(), the model and the conversation
    bank_option_names: tuple[str, ...] = ("retriever", "turns_per_segment", "embedding_options", "system_prompt")

    def __init__(
        self,
        answer_template: str,
        retriever: str = "bm25",
        turns_per_segment: int = 8,
        max_batch: int = 32,
        system_prompt: str | None = None,
        judge: LLMJudge | None = None,
        embedding: str = "hashing",
        embedding_dim: int = 256,
        embedding_model: str | None = None,
        bank_cache: str | None = None,
    ) -> None:
        check_placeholders(("answer_template", answer_template, ("{memories}", "{question}")))
        if turns_per_segment < 0 or max_batch < 1:
            raise ValueError("workflow turns_per_segment must be >= 0 and max_batch >= 1")
        if bank_cache is not None and not self.caches_banks_to_file:
            raise ValueError(f"workflow bank_cache: {type(self).__name__} does not keep its banks in a file; remove it")
        self.bank_cache = BankCacheFile(bank_cache) if bank_cache is not None else None
        self.embedding_options = {"embedding": embedding, "embedding_dim": embedding_dim, "model": embedding_model}
        self.retriever = retriever
        MemoryBank(retriever)  # fail early on a bad retriever name
        self.embedder: Embedder = build_embedder(embedding, embedding_dim, embedding_model)
        self.turns_per_segment = turns_per_segment
        self.max_batch = max_batch
        self.system_prompt = system_prompt
        self.judge = judge
        self.answer_template = answer_template
        self._bank_cache: dict[str, MemoryBank] = {}  # conversation id -> greedily built bank
        self.counters: Counter[str] = Counter()  # lifetime counts (ops, invalid outputs, ...)

    # ------------------------------------------------------------------ helpers for subclasses
    def new_bank(self) -> MemoryBank:
        return MemoryBank(self.retriever, self.embedder)

    def segments(self, conversation: Conversation) -> list[Segment]:
        return split_segments(conversation, self.turns_per_segment)

    def generate_turns(
        self,
        engine: RolloutBackend,
        texts: list[str],
        settings: GenerationSettings,
        max_new_tokens: int,
        kind: str,
        trainable: bool,
    ) -> list[Turn]:
        """One turn per prompt text, generated in batches of ``max_batch``."""
        tokenizer = engine.tokenizer
        prompts = [encode_chat_prompt(t, tokenizer, self.system_prompt) for t in texts]
        turns = []
        for start in range(0, len(prompts), self.max_batch):
            batch = prompts[start : start + self.max_batch]
            for prompt, gen in zip(batch, engine.generate(batch, settings, max_new_tokens=max_new_tokens)):
                text = tokenizer.decode(gen.token_ids, skip_special_tokens=True).strip()
                turns.append(Turn(kind, prompt, gen, text, trainable=trainable))
        return turns

    def engine_for(self, engine: RolloutBackend, trained: bool) -> RolloutBackend:
        """The engine an agent generates with: the policy's when the agent is ``trained`` in this
        stage (also in validation), else :attr:`frozen_engine`.

        Raises:
            RuntimeError: a frozen agent while no frozen engine was set although the policy trains.
        """
        if trained:
            return engine
        if self.frozen_engine is not None:
            return self.frozen_engine
        if self.needs_frozen_model():
            raise RuntimeError(
                f"{type(self).__name__} has frozen agents but no frozen_engine: MemRLModule sets it in "
                "configure_model; when calling rollout yourself set workflow.frozen_engine to a "
                "RolloutBackend over a model that does not train"
            )
        return engine  # nothing trains the policy: it is the fixed model

    def answer_engine(self, engine: RolloutBackend, trainable: bool) -> RolloutBackend:
        """The answerer's engine: :meth:`engine_for` (not trained: the frozen model, never the policy)."""
        return self.engine_for(engine, trainable)

    def policy_will_change(self) -> None:
        """Drop results the policy built greedily: a training rollout precedes an optimizer step."""
        self._bank_cache.clear()

    @staticmethod
    def describe(engine: RolloutBackend) -> str:
        """Which model ``engine`` generates with (for logs)."""
        return engine_description(engine)

    # ------------------------------------------------------------------ to implement
    def build_banks(
        self,
        engine: RolloutBackend,
        conversations: list[Conversation],
        settings: GenerationSettings,
        trainable: bool,
    ) -> list[tuple[MemoryBank, list[Turn]]]:
        """One bank per entry of ``conversations`` with the turns that wrote it."""
        raise NotImplementedError

    def answer_is_trained(self) -> bool:
        """True when the answer turns are trained (the policy answers with sampling during training)."""
        raise NotImplementedError

    def show_memories(self, trajectories: list[Trajectory], banks: list[MemoryBank], training: bool) -> list[str]:
        """The memories each answer prompt shows, rendered (record them with :func:`record_shown`)."""
        raise NotImplementedError

    def read_answer(self, trajectory: Trajectory, response: str) -> str:
        """What the rewards score of a raw answer ``response`` (here: what follows its last ``Answer:``).

        Overrides may read more of the response (cited memories) into ``trajectory.info``.
        """
        return answer_part(response)

    def banks_are_frozen(self) -> bool:
        """True when no bank-writing turn is trained (banks are then built once and cached)."""
        return True

    # ------------------------------------------------------------------ the rollout
    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        conversations = [conversation_of(t) for t in tasks]
        trajectories = [Trajectory(task=t, chunks=list(t.context)) for t in tasks]
        evaluating = settings.temperature <= 0
        if self.banks_are_frozen() or evaluating:
            missing = list({c.id: c for c in conversations if c.id not in self._bank_cache}.values())
            if missing:
                self.build_greedy_banks(engine, missing, settings.greedy(), from_file=self.banks_are_frozen())
            banks = [self._bank_cache[c.id] for c in conversations]
        else:
            self.policy_will_change()  # greedy banks the policy built go stale
            built = self.build_banks(engine, conversations, settings, trainable=True)
            banks = []
            for trajectory, (bank, turns) in zip(trajectories, built):
                trajectory.turns.extend(turns)
                banks.append(bank)
        for trajectory, bank in zip(trajectories, banks):
            trajectory.info["bank_size"] = len(bank)
        self.answer(engine, trajectories, banks, settings)
        return trajectories

    def build_greedy_banks(
        self, engine: RolloutBackend, conversations: list[Conversation], settings: GenerationSettings, from_file: bool
    ) -> list[MemoryBank]:
        """Greedy banks into memory: from ``bank_cache`` when ``from_file`` and it has them, else built (and stored)."""
        file = self.bank_cache if from_file else None
        recipe = self.bank_recipe(engine, settings) if file is not None else {}
        stored = {c.id: file.get(recipe, c) for c in conversations} if file is not None else {}
        todo = [c for c in conversations if stored.get(c.id) is None]
        for conversation in (c for c in conversations if stored.get(c.id) is not None):
            self._bank_cache[conversation.id] = bank = self.new_bank()
            bank.load_state_dict(stored[conversation.id])
        if file is not None:
            log.info("%d of %d banks read from %s", len(conversations) - len(todo), len(conversations), file.path)
        if todo:
            start = time.perf_counter()
            built = [bank for bank, _ in self.build_banks(engine, todo, settings, trainable=False)]
            self._bank_cache.update({c.id: bank for c, bank in zip(todo, built)})
            if file is not None:
                file.put(recipe, [(c, bank.state_dict()) for c, bank in zip(todo, built)], time.perf_counter() - start)
        return [self._bank_cache[c.id] for c in conversations]

    def bank_options(self) -> dict[str, Any]:
        """The options and prompts that shape a bank (``bank_option_names``; part of a ``bank_cache`` key)."""
        return {name: getattr(self, name) for name in self.bank_option_names}

    def bank_recipe(self, engine: RolloutBackend, settings: GenerationSettings) -> dict[str, Any]:
        """A ``bank_cache`` key's recipe (the model that builds frozen banks: ``engine_for(engine, False)``)."""
        return bank_recipe(type(self).__name__, self.bank_options(), settings, self.engine_for(engine, False))

    def answer_prompt(self, question: str, conversation: Conversation, memories: str) -> str:
        """The answer agent's prompt: ``question`` about ``conversation`` with the rendered ``memories``."""
        return self.answer_template.format(
            memories=memories, question=question, speaker_a=conversation.speaker_a, speaker_b=conversation.speaker_b
        )

    def answer(
        self,
        engine: RolloutBackend,
        trajectories: list[Trajectory],
        banks: list[MemoryBank],
        settings: GenerationSettings,
    ) -> None:
        """Append the answer turn of every trajectory (its raw response kept in ``info["answer_raw"]``).

        The prompt (``answer_template``) shows :meth:`show_memories`; the answerer is the policy
        when :meth:`answer_is_trained`, else the frozen model, which answers greedily in training rollouts too.
        """
        training = settings.temperature > 0
        texts = []
        for trajectory, memories in zip(trajectories, self.show_memories(trajectories, banks, training)):
            texts.append(self.answer_prompt(trajectory.task.question, conversation_of(trajectory.task), memories))
        trainable = self.answer_is_trained()
        gen_settings = settings if trainable or not training else settings.greedy()
        answerer = self.answer_engine(engine, trainable)
        turns = self.generate_turns(answerer, texts, gen_settings, settings.max_new_tokens, ANSWER_TURN, trainable)
        for trajectory, turn in zip(trajectories, turns):
            trajectory.info["answer_raw"] = turn.text
            turn.text = self.read_answer(trajectory, turn.text)
            trajectory.turns.append(turn)

    # ------------------------------------------------------------------ evaluation and state
    def evaluation_metrics(self, trajectory: Trajectory) -> dict[str, float | None]:
        """Evidence recall of what the answerer was shown, and the judge's score when configured."""
        metrics: dict[str, float | None] = {
            "evidence_recall": evidence_recall(
                trajectory.info.get("shown_source_ids", []), trajectory.task.meta.get("evidence", [])
            )
        }
        if self.judge is not None:
            metrics["judge"] = self.judge(*judge_item(trajectory))
        return metrics

    def prepare_evaluation(self, trajectories: list[Trajectory]) -> None:
        """Judge the batch's answers concurrently (``judge.max_workers`` at a time) when a judge is set."""
        if self.judge is not None:
            self.judge.prefetch([judge_item(t) for t in trajectories])

    def state_dict(self) -> dict[str, Any]:
        return {
            "banks": {cid: bank.state_dict() for cid, bank in self._bank_cache.items()},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bank_cache = {}
        for cid, bank_state in state.get("banks", {}).items():
            bank = self.new_bank()
            bank.load_state_dict(bank_state)
            self._bank_cache[cid] = bank
        self.counters = Counter(state.get("counters", {}))


def judge_item(trajectory: Trajectory) -> tuple[str, list[str], str]:
    """What the judge sees of a trajectory: its question, gold answers and answer."""
    return trajectory.task.question, trajectory.task.answers, trajectory.info.get("answer", trajectory.final_text)


def answer_part(text: str) -> str:
    """What follows the last ``Answer:`` of a response (the whole text when there is none)."""
    index = text.lower().rfind("answer:")
    return text[index + len("answer:") :].strip() if index >= 0 else text.strip()
