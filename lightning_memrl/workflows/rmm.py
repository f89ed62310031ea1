"""RMM, Reflective Memory Management (arXiv:2503.08026): prospective reflection into topic memories, a
learned reranker.

Prospective reflection: after each session (segment) the model summarises the topics discussed;
each topic memory is added to the bank, or merged into one of the ``merge_top_k`` most similar
entries when the model says so. An entry is the topic summary plus the source turns it came
from (shown with it when ``show_raw``).

Retrospective reflection: for a question, retrieval returns the top ``top_k`` entries (K); a
:class:`Reranker` — linear adapters with residual connections over query and memory embeddings,
dot-product scores — keeps ``top_m`` of them (M), sampled with Gumbel noise during training and
the best M at evaluation. The generator answers and cites the memories it used; each shown memory
gets a citation reward (+1 cited, −1 not), and the reranker is trained by REINFORCE,
``loss = −Σ_i (r_i − b)·log softmax(s/τ)_i`` with a running-mean baseline ``b``. That loss is the
workflow's :meth:`module_loss`: ``MemRLModule`` backpropagates it in the same training step, and
the reranker is registered as a module, so its parameters are in the optimizer and the checkpoint.
The answer turns themselves are trained by GRPO like any other turn (``train_generator``).

Prospective reflection is never trained: it runs greedily on the workflow's ``frozen_engine`` (a
model that does not train, see :mod:`lightning_memrl.workflows.bank`), once per conversation, and
the bank is cached; a log line names the model that built it. The generator is the policy when
``train_generator``; otherwise nothing trains the policy and it serves as the fixed model.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memrl.data.locomo import Conversation
from lightning_memrl.errors import check_placeholders
from lightning_memrl.evaluation.metrics import evidence_recall
from lightning_memrl.memory.bank import MemoryBank, MemoryEntry, MemoryOp
from lightning_memrl.memory.operations import parse_memory_operation
from lightning_memrl.rollout.base import RolloutBackend
from lightning_memrl.settings import GenerationSettings
from lightning_memrl.types import MEMORY_TURN, RolloutBatch, Task, Trajectory, Turn
from lightning_memrl.workflows.bank import BankWorkflow, answer_part, conversation_of, parse_items, record_shown

log = logging.getLogger(__name__)


REFLECT_TURN = "reflect"


DEFAULT_REFLECT_TEMPLATE = (
    "Here is part of a conversation ({date}):\n{dialogue}\n\n"
    "List at most {max_topics} topics discussed, one per line, each a short summary with names and dates, "
    "starting with the turn it comes from, e.g.\n[D1:3] Caroline went to an LGBTQ support group on 7 May 2023."
)


DEFAULT_MERGE_TEMPLATE = (
    "Existing memories similar to a new one:\n{memories}\n\nNew memory ({date}): {memory}\n\n"
    "If the new memory is about the same topic as a listed one, MERGE it into that one; otherwise ADD it. "
    'Reply with JSON only: {{"op": "ADD"}} or {{"op": "MERGE", "id": "m3", "text": "the merged memory"}}.'
)


DEFAULT_ANSWER_TEMPLATE = (
    "Memories from a conversation between {speaker_a} and {speaker_b}:\n{memories}\n\nQuestion: {question}\n\n"
    "Answer briefly, then list the numbers of the memories you used:\n"
    "Answer: \\boxed{{answer}}\nCitations: [1, 2]"
)


# --------------------------------------------------------------------------- the reranker
class Reranker(nn.Module):
    """Scores ``s_k = (m_k + A_m m_k) · (q + A_q q)``: residual linear adapters, identity at start.

    Args:
        dim: embedding size.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query_adapter = nn.Linear(dim, dim)
        self.memory_adapter = nn.Linear(dim, dim)
        for layer in (self.query_adapter, self.memory_adapter):  # start as plain dot-product retrieval
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, query: Tensor, memories: Tensor) -> Tensor:
        """``query`` [D], ``memories`` [K, D] -> scores [K]."""
        q = query + self.query_adapter(query)  # [D]
        m = memories + self.memory_adapter(memories)  # [K, D]
        return m @ q  # [K]


def gumbel_top_m(scores: Tensor, m: int, temperature: float, noise: bool = True, generator: Any = None) -> Tensor:
    """Indices [min(m, K)] of the top entries of ``scores / temperature`` (+ Gumbel noise when ``noise``)."""
    logits = scores.detach() / temperature  # [K]
    if noise:
        uniform = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9).to(logits.device)
        logits = logits - torch.log(-torch.log(uniform))
    return torch.topk(logits, min(m, logits.numel())).indices


def selection_log_probs(scores: Tensor, indices: Tensor, temperature: float) -> Tensor:
    """``log softmax(scores / temperature)`` [K] at the selected ``indices`` -> [M]."""
    return torch.log_softmax(scores / temperature, dim=-1)[indices]


def parse_citations(text: str, num_shown: int) -> set[int]:
    """0-based positions of the memories a response cites (numbers 1..``num_shown``).

    Reads the numbers after the last "citation(s):" when there is one, else every number inside
    square brackets (``[1][3]``, ``[1, 3]``).
    """
    lower = text.lower()
    index = lower.rfind("citation")
    if index >= 0:
        numbers = re.findall(r"\d+", text[index:])
    else:
        numbers = [n for group in re.findall(r"\[([\d,\s]+)\]", text) for n in re.findall(r"\d+", group)]
    return {int(n) - 1 for n in numbers if 1 <= int(n) <= num_shown}


def citation_rewards(cited: set[int], num_shown: int) -> Tensor:
    """+1 for each shown memory the generator cited, −1 for each it did not -> [num_shown]."""
    return torch.tensor([1.0 if i in cited else -1.0 for i in range(num_shown)])


def reinforce_loss(log_probs: Tensor, rewards: Tensor, baseline: float) -> Tensor:
    """``−Σ_i (r_i − b)·log p_i``: descending it raises the probability of memories with r_i > b."""
    return -((rewards.to(log_probs.device) - baseline) * log_probs).sum()


def _strip_citations(answer: str) -> str:
    answer = re.split(r"citations?\s*:", answer, flags=re.IGNORECASE)[0]
    return re.sub(r"\[[\d,\s]+\]", " ", answer).strip()


# --------------------------------------------------------------------------- the workflow
class RMMWorkflow(BankWorkflow):
    """RMM on LoCoMo conversations (see the module docstring).

    Args:
        turns_per_segment: dialogue turns per reflection call (0: a whole session, as in RMM).
        max_topics: topic memories kept per reflection.
        merge_top_k: similar entries shown when deciding to add or merge a topic (none similar: add).
        top_k: candidates retrieved for a question (RMM's K).
        top_m: memories the reranker keeps and the generator sees (RMM's M).
        temperature: softmax temperature τ of the reranker's selection distribution.
        gumbel: sample the top M with Gumbel noise during training (evaluation takes the best M).
        embedding: ``hashing`` (offline, no weights) or ``sentence-transformers`` (the ``dense`` extra):
            the reranker's vectors, and those of ``retriever: dense``.
        embedding_dim: size of ``hashing`` embeddings.
        embedding_model: sentence-transformers model path (None: the bundled all-MiniLM-L6-v2).
        reranker_lr: learning rate of the reranker's parameters.
        baseline_momentum: running-mean factor of the REINFORCE baseline ``b``.
        train_generator: train the answer turns with GRPO (else only the reranker learns).
        show_raw: show each memory's source turns to the generator under its summary.
        reflect_max_tokens: generation cap of a reflection turn.
        merge_max_tokens: generation cap of an add-or-merge turn.
        reflect_template: prompt with ``{date}``, ``{dialogue}``, ``{max_topics}``.
        merge_template: prompt with ``{memories}``, ``{memory}``, ``{date}``.
        answer_template: prompt of the generator (see :class:`BankWorkflow`).
        **kwargs: ``retriever`` (first-stage retrieval of the top ``top_k``), ``max_batch``,
            ``system_prompt``, ``judge`` of :class:`BankWorkflow`.
    """

    records_memory_writes = True  # add-or-merge turns note turn.info["wrote_entries"]

    def __init__(
        self,
        turns_per_segment: int = 0,
        max_topics: int = 4,
        merge_top_k: int = 3,
        top_k: int = 20,
        top_m: int = 5,
        temperature: float = 0.5,
        gumbel: bool = True,
        embedding: str = "hashing",
        embedding_dim: int = 256,
        embedding_model: str | None = None,
        reranker_lr: float = 1e-3,
        baseline_momentum: float = 0.9,
        train_generator: bool = True,
        show_raw: bool = True,
        reflect_max_tokens: int = 96,
        merge_max_tokens: int = 48,
        reflect_template: str = DEFAULT_REFLECT_TEMPLATE,
        merge_template: str = DEFAULT_MERGE_TEMPLATE,
        answer_template: str = DEFAULT_ANSWER_TEMPLATE,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            answer_template,
            turns_per_segment=turns_per_segment,
            embedding=embedding,
            embedding_dim=embedding_dim,
            embedding_model=embedding_model,
            **kwargs,
        )
        if not 1 <= top_m <= top_k:
            raise ValueError(f"workflow needs 1 <= top_m <= top_k, got top_m={top_m}, top_k={top_k}")
        if temperature <= 0 or not 0 <= baseline_momentum < 1:
            raise ValueError("workflow temperature must be > 0 and baseline_momentum in [0, 1)")
        check_placeholders(
            ("reflect_template", reflect_template, ("{dialogue}",)),
            ("merge_template", merge_template, ("{memories}", "{memory}")),
        )
        self.reranker = Reranker(self.embedder.dim)
        self.module_lr = reranker_lr
        self.max_topics, self.merge_top_k, self.top_k, self.top_m = max_topics, merge_top_k, top_k, top_m
        self.temperature, self.gumbel = temperature, gumbel
        self.baseline_momentum, self.baseline = baseline_momentum, 0.0
        self.train_generator, self.show_raw = train_generator, show_raw
        self.reflect_max_tokens, self.merge_max_tokens = reflect_max_tokens, merge_max_tokens
        self.reflect_template, self.merge_template = reflect_template, merge_template
        self._selections: list[tuple[Tensor, Tensor] | None] = []  # (scores [K], chosen [M]) of the last answers
        self._pending_loss: Tensor | None = None  # of the last training rollout, until module_loss takes it
        self._pending_metrics: dict[str, float] = {}  # of the last training rollout, until step_metrics takes them

    def torch_modules(self) -> dict[str, nn.Module]:
        return {"reranker": self.reranker}

    def needs_frozen_model(self) -> bool:
        """The reflection is frozen while the generator (the policy) trains."""
        return self.train_generator

    def max_response_tokens(self, settings: GenerationSettings) -> int:
        return max(settings.max_new_tokens, self.reflect_max_tokens, self.merge_max_tokens)

    # ------------------------------------------------------------------ prospective reflection
    def build_banks(
        self, engine: RolloutBackend, conversations: list[Conversation], settings: GenerationSettings, trainable: bool
    ) -> list[tuple[MemoryBank, list[Turn]]]:
        engine = self.engine_for(engine, False)  # prospective reflection is never trained
        segments = [self.segments(c) for c in conversations]
        jobs = [(slot, r, seg) for slot, segs in enumerate(segments) for r, seg in enumerate(segs)]
        texts = [
            self.reflect_template.format(date=seg.session.date_time, dialogue=seg.text, max_topics=self.max_topics)
            for _, _, seg in jobs
        ]
        reflections = self.generate_turns(engine, texts, settings, self.reflect_max_tokens, REFLECT_TURN, trainable)
        topics: dict[tuple[int, int], list[tuple[str, list[str]]]] = {}
        banks = [self.new_bank() for _ in conversations]
        turns: list[list[Turn]] = [[] for _ in conversations]
        counts: Counter[str] = Counter()
        for (slot, r, seg), turn in zip(jobs, reflections):
            topics[(slot, r)] = parse_items(turn.text, seg.source_ids, self.max_topics, counts)
            turns[slot].append(turn)
        for r in range(max((len(s) for s in segments), default=0)):
            merge_jobs, merge_texts = [], []
            for slot, segs in enumerate(segments):
                if r >= len(segs):
                    continue
                session = segs[r].session
                for topic, sources in topics[(slot, r)]:
                    counts["topics"] += 1
                    similar = [e for e, _ in banks[slot].retrieve(topic, self.merge_top_k)]
                    if not similar:  # nothing to merge with: add without asking
                        banks[slot].add(topic, session.name, session.date_time, sources)
                        counts["ADD"] += 1
                        continue
                    merge_jobs.append((slot, session, topic, sources, {e.id: e for e in similar}))
                    merge_texts.append(
                        self.merge_template.format(
                            memories=banks[slot].format(similar), memory=topic, date=session.date_time
                        )
                    )
            outputs = self.generate_turns(engine, merge_texts, settings, self.merge_max_tokens, MEMORY_TURN, trainable)
            for (slot, session, topic, sources, similar), turn in zip(merge_jobs, outputs):
                parsed = parse_memory_operation(turn.text, set(similar), topic)
                bank = banks[slot]
                if parsed.valid and parsed.op is MemoryOp.UPDATE and parsed.target_id in bank:
                    old = bank.get(str(parsed.target_id))
                    merged = parsed.text if parsed.text != " ".join(topic.split()) else f"{old.text} {topic}"
                    entry = bank.update(old.id, merged, sources)
                    counts["MERGE"] += 1
                else:  # ADD, or anything else (a NOOP/DELETE is not an RMM choice): keep the topic
                    counts["invalid" if not parsed.valid or parsed.op is not MemoryOp.ADD else "ADD"] += 1
                    entry = bank.add(topic, session.name, session.date_time, sources)
                turn.info["wrote_entries"] = {entry.id: entry.text}  # which turn wrote which entry
                turns[slot].append(turn)
        self.counters.update(counts)
        if counts["invalid"]:
            log.warning("RMM reflection: %d add-or-merge outputs unusable (topic added)", counts["invalid"])
        log.info(
            "RMM reflection by %s over %d conversations: %s", self.describe(engine), len(conversations), dict(counts)
        )
        return list(zip(banks, turns))

    # ------------------------------------------------------------------ retrospective reflection
    def _render(self, position: int, entry: MemoryEntry, conversation: Conversation) -> str:
        line = f"[{position}]" + (f" ({entry.time})" if entry.time else "") + f" {entry.text}"
        if self.show_raw:
            by_id = {t.dia_id: t for s in conversation.sessions for t in s.turns}
            raw = [by_id[i].render() for i in entry.source_ids if i in by_id]
            line += "".join(f"\n    {r}" for r in raw)
        return line

    def answer_is_trained(self) -> bool:
        return self.train_generator

    def show_memories(self, trajectories: list[Trajectory], banks: list[MemoryBank], training: bool) -> list[str]:
        """The ``top_m`` of the ``top_k`` retrieved memories that the reranker keeps (sampled when training)."""
        device = self.reranker.query_adapter.weight.device
        self._selections, rendered = [], []
        for trajectory, bank in zip(trajectories, banks):
            candidates = [e for e, _ in bank.retrieve(trajectory.task.question, self.top_k)]
            trajectory.info["candidate_source_ids"] = sorted({s for e in candidates for s in e.source_ids})
            shown: list[MemoryEntry] = []
            selection = None
            if candidates:
                query = self.embedder.embed([trajectory.task.question])[0].to(device)  # [D]
                memories = self.embedder.embed([e.text for e in candidates]).to(device)  # [K, D]
                scores = self.reranker(query, memories)  # [K]
                chosen = gumbel_top_m(scores, self.top_m, self.temperature, noise=training and self.gumbel)
                selection, shown = (scores, chosen), [candidates[i] for i in chosen.tolist()]
            self._selections.append(selection)
            record_shown(trajectory, shown)
            conversation = conversation_of(trajectory.task)
            rendered.append(
                "\n".join(self._render(k + 1, e, conversation) for k, e in enumerate(shown)) or "(no memories)"
            )
        return rendered

    def read_answer(self, trajectory: Trajectory, response: str) -> str:
        """The answer without citations; the cited memories and their rewards (+1/−1) go to ``info``."""
        cited = parse_citations(response, len(trajectory.info["shown_ids"]))
        rewards = citation_rewards(cited, len(trajectory.info["shown_ids"]))  # [M]
        trajectory.info.update(cited=sorted(cited), citation_rewards=rewards.tolist())
        return _strip_citations(answer_part(response))

    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        """The bank workflow's rollout; a training rollout also readies the reranker's loss (:meth:`module_loss`)."""
        trajectories = super().rollout(engine, tasks, settings)
        if settings.temperature > 0:
            self._pending_loss, self._pending_metrics = self._reranker_update(trajectories)
        return trajectories

    def _reranker_update(self, trajectories: list[Trajectory]) -> tuple[Tensor | None, dict[str, float]]:
        """REINFORCE loss of the last selections under the citation rewards; moves the baseline ``b``."""
        losses, rewards_all = [], []
        for trajectory, selection in zip(trajectories, self._selections):
            rewards = torch.tensor(trajectory.info["citation_rewards"])  # [M]
            if selection is not None and torch.is_grad_enabled():
                scores, chosen = selection
                losses.append(
                    reinforce_loss(selection_log_probs(scores, chosen, self.temperature), rewards, self.baseline)
                )
            rewards_all.append(rewards)
        self._selections = []
        flat = torch.cat(rewards_all) if rewards_all else torch.zeros(0)
        mean_reward = float(flat.mean()) if flat.numel() else 0.0
        metrics = {
            "reranker/loss": float(torch.stack(losses).detach().mean()) if losses else 0.0,
            "reranker/citation_reward": mean_reward,
            "reranker/baseline": self.baseline,
            "reranker/cited_frac": float((flat > 0).float().mean()) if flat.numel() else 0.0,
        }
        if flat.numel():
            self.baseline = self.baseline_momentum * self.baseline + (1 - self.baseline_momentum) * mean_reward
        return (torch.stack(losses).mean() if losses else None), metrics

    def module_loss(self, rollouts: RolloutBatch) -> Tensor | None:
        """The reranker's REINFORCE loss of the last training rollout (taken: a second call gives None)."""
        loss, self._pending_loss = self._pending_loss, None
        return loss

    def step_metrics(self, rollouts: RolloutBatch) -> dict[str, float]:
        """The reranker's loss, citation reward, baseline and cited fraction of the last training rollout (taken)."""
        metrics, self._pending_metrics = self._pending_metrics, {}
        return metrics

    # ------------------------------------------------------------------ evaluation and state
    def evaluation_metrics(self, trajectory: Trajectory) -> dict[str, float | None]:
        """Evidence recall after reranking (top M) and of the first-stage top K, plus the judge."""
        metrics = super().evaluation_metrics(trajectory)
        metrics["evidence_recall_at_k"] = evidence_recall(
            trajectory.info.get("candidate_source_ids", []), trajectory.task.meta.get("evidence", [])
        )
        cited = trajectory.info.get("citation_rewards", [])
        metrics["citation_reward"] = sum(cited) / len(cited) if cited else None
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "baseline": self.baseline}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.baseline = float(state.get("baseline", 0.0))
