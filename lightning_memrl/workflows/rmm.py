"""RMM, Reflective Memory Management (arXiv:2503.08026): reflection into topic memories, a learned reranker.

Prospective reflection: after each session (segment) the model summarises the topics discussed; each topic
memory is added to the bank, or merged into one of the ``merge_top_k`` most similar entries when the model says
so. An entry is the topic summary plus the source turns it came from (shown with it when ``show_raw``).

Retrospective reflection: for a question, retrieval returns the top ``top_k`` entries (K); a :class:`Reranker` —
linear adapters with residual connections over query and memory embeddings, dot-product scores — keeps ``top_m``
of them (M), sampled with Gumbel noise during training and the best M at evaluation. During training the M
memories are shown in a random order (``shuffle_shown``), so that citing "the first two" does not reward the
reranker's top picks. The generator answers and cites the memories it used; each shown memory gets a citation
reward (+1 cited, −1 not), and the reranker is trained by REINFORCE, ``loss = −Σ_i (r_i − b)·log
softmax(s/τ)_i`` with a running-mean baseline ``b``. That loss is the workflow's :meth:`module_loss`:
``MemRLModule`` backpropagates it in the same training step, and the reranker is registered as a module, so its
parameters are in the optimizer and the checkpoint. The answer turns themselves are trained by GRPO like any
other turn (``train_generator``). ``reranker_reward: evidence`` replaces the citation reward by one read from
the data's evidence annotations (not RMM's, see :class:`RMMWorkflow`).

Prospective reflection is never trained: it runs greedily on the workflow's ``frozen_engine`` (a model that does
not train, see :mod:`lightning_memrl.workflows.bank`), once per conversation, and the bank is cached; a log line
names the model that built it. The generator is the policy when ``train_generator``; otherwise nothing trains
the policy and it serves as the fixed model.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Literal

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
from lightning_memrl.workflows.rmm_reranker import (
    RERANKER_REWARDS,
    Reranker,
    SourceTurnScorer,
    citation_rewards,
    evidence_rewards,
    gumbel_top_m,
    parse_citations,
    reinforce_loss,
    selection_log_probs,
    shown_order,
    strip_citations,
    varied_group_share,
)

__all__ = ["Reranker", "RMMWorkflow", "citation_rewards", "evidence_rewards", "gumbel_top_m", "parse_citations"]
__all__ += ["reinforce_loss", "selection_log_probs"]

log = logging.getLogger(__name__)

REFLECT_TURN = "reflect"

# No literal example topic: SmolLM2-135M wrote the example itself into 60% of the memories (88 of 138 over
# 6 sessions of 4 LoCoMo conversations); a copy that slips through is dropped (parse_items, "copied").
DEFAULT_REFLECT_TEMPLATE = (
    "Here is part of a conversation ({date}):\n{dialogue}\n\n"
    "List at most {max_topics} topics discussed, one per line, each a short summary with names and dates, "
    "starting with the id of the turn it comes from in brackets, like [D1:3]."
)

DEFAULT_MERGE_TEMPLATE = (
    "Existing memories similar to a new one:\n{memories}\n\nNew memory ({date}): {memory}\n\n"
    "If the new memory is about the same topic as a listed one, MERGE it into that one; otherwise ADD it. "
    'Reply with JSON only: {{"op": "ADD"}} or {{"op": "MERGE", "id": "m3", "text": "the merged memory"}}.'
)

# No literal citation example: a small generator copies one ("Citations: [1, 2]") whatever it was shown.
DEFAULT_ANSWER_TEMPLATE = (
    "Memories from a conversation between {speaker_a} and {speaker_b}:\n{memories}\n\nQuestion: {question}\n\n"
    "Answer briefly, then list the numbers of the memories you used:\n"
    "Answer: \\boxed{{answer}}\nCitations: [numbers of the memories you used]"
)


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
        shuffle_shown: show the M kept memories in a random order during training (recorded in
            ``info["shown_order"]``; citations are mapped back), so that a generator citing the first
            numbers does not reward the reranker's top picks. Evaluation keeps the reranker's order.
        min_retrieval_score: first-stage candidates must score above it (None: no cut, the top
            ``top_k`` are always filled; 0.0 drops entries sharing no term with the question under BM25).
        reranker_reward: what rewards a shown memory in the reranker's REINFORCE update. ``citation`` (RMM): +1
            when the generator cites it, −1 otherwise. ``evidence`` (NOT RMM's): +1 when its source turns overlap
            the question's annotated evidence ``dia_id``s, −1 otherwise, a supervised signal from LoCoMo's
            annotations for a generator too small to cite; results with it are not RMM's. Questions without
            evidence then give the reranker no loss (``reranker/no_evidence``). Validation is the same for both.
        embedding: ``hashing`` (offline) or ``sentence-transformers`` (``dense`` extra): the reranker's vectors.
        embedding_dim: size of ``hashing`` embeddings.
        embedding_model: sentence-transformers model path (None: the bundled all-MiniLM-L6-v2).
        reranker_lr: learning rate of the reranker's parameters.
        first_stage_feature: (not in RMM) also a learned weight on the first-stage scores (see :class:`Reranker`).
        source_turn_feature: (not in RMM) also a learned weight on each candidate's best source-turn match.
        feature_lr_scale: learning-rate multiplier of those feature weights (see :class:`Reranker`).
        baseline_momentum: running-mean factor of the REINFORCE baseline ``b``.
        train_generator: train the answer turns with GRPO (else only the reranker learns).
        reflect_with_base: prospective reflection on the base model (the frozen engine) even when the
            generator does not train, e.g. a warm-started generator (``configs/rmm/sft.yaml``): banks stay the base's.
        show_raw: show each memory's source turns to the generator under its summary.
        reflect_max_tokens: generation cap of a reflection turn.
        merge_max_tokens: generation cap of an add-or-merge turn.
        reflect_template: prompt with ``{date}``, ``{dialogue}``, ``{max_topics}``.
        merge_template: prompt with ``{memories}``, ``{memory}``, ``{date}``.
        answer_template: prompt of the generator (see :class:`BankWorkflow`).
        **kwargs: ``retriever`` (first-stage retrieval of the top ``top_k``), ``max_batch``,
            ``system_prompt``, ``judge``, ``bank_cache`` (a file of the reflection's banks) of :class:`BankWorkflow`.
    """

    records_memory_writes = True  # add-or-merge turns note turn.info["wrote_entries"]
    caches_banks_to_file = True  # a bank depends only on the reflection's options, the model and the conversation
    bank_option_names = (*BankWorkflow.bank_option_names, "max_topics", "merge_top_k", "reflect_max_tokens")
    bank_option_names += ("merge_max_tokens", "reflect_template", "merge_template")

    def __init__(
        self,
        turns_per_segment: int = 0,
        max_topics: int = 4,
        merge_top_k: int = 3,
        top_k: int = 20,
        top_m: int = 5,
        temperature: float = 0.5,
        gumbel: bool = True,
        shuffle_shown: bool = True,
        min_retrieval_score: float | None = None,
        reranker_reward: Literal["citation", "evidence"] = "citation",
        embedding: str = "hashing",
        embedding_dim: int = 256,
        embedding_model: str | None = None,
        reranker_lr: float = 1e-3,
        first_stage_feature: bool = False,
        source_turn_feature: bool = False,
        feature_lr_scale: float = 1.0,
        baseline_momentum: float = 0.9,
        train_generator: bool = True,
        reflect_with_base: bool = False,
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
        if temperature <= 0 or not 0 <= baseline_momentum < 1 or feature_lr_scale <= 0:
            raise ValueError("workflow temperature and feature_lr_scale must be > 0 and baseline_momentum in [0, 1)")
        if reranker_reward not in RERANKER_REWARDS:
            raise ValueError(f"workflow reranker_reward must be one of {RERANKER_REWARDS}, got {reranker_reward!r}")
        check_placeholders(
            ("reflect_template", reflect_template, ("{dialogue}",)),
            ("merge_template", merge_template, ("{memories}", "{memory}")),
        )
        self.reranker = Reranker(self.embedder.dim, first_stage_feature, source_turn_feature, feature_lr_scale)
        self.source_turns = SourceTurnScorer(self.embedder) if source_turn_feature else None
        self.module_lr, self.reranker_reward = reranker_lr, reranker_reward
        self.max_topics, self.merge_top_k, self.top_k, self.top_m = max_topics, merge_top_k, top_k, top_m
        self.shuffle_shown, self.min_retrieval_score, self.gumbel = shuffle_shown, min_retrieval_score, gumbel
        self.temperature, self.baseline_momentum, self.baseline = temperature, baseline_momentum, 0.0
        self.train_generator, self.reflect_with_base, self.show_raw = train_generator, reflect_with_base, show_raw
        self.reflect_max_tokens, self.merge_max_tokens = reflect_max_tokens, merge_max_tokens
        self.reflect_template, self.merge_template = reflect_template, merge_template
        self._selections: list[tuple[Tensor, Tensor] | None] = []  # (scores [K], chosen [M]) of the last answers
        self._pending_loss: Tensor | None = None  # of the last training rollout, until module_loss takes it
        self._pending_metrics: dict[str, float] = {}  # of the last training rollout, until step_metrics takes them

    def torch_modules(self) -> dict[str, nn.Module]:
        return {"reranker": self.reranker}

    def needs_frozen_model(self) -> bool:
        """The reflection is frozen while the generator (the policy) trains, or on request (``reflect_with_base``)."""
        return self.train_generator or self.reflect_with_base

    def answer_engine(self, engine: RolloutBackend, trainable: bool) -> RolloutBackend:
        """The generator is the policy, trained or not (a frozen engine only ever reflects)."""
        return engine

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
            topics[(slot, r)] = parse_items(turn.text, seg.source_ids, self.max_topics, counts, self.reflect_template)
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
        if counts["copied"]:
            log.warning("RMM reflection: %d topics repeat the prompt's own words (dropped)", counts["copied"])
        log.info(
            "RMM reflection by %s over %d conversations: %s", self.describe(engine), len(conversations), dict(counts)
        )
        return list(zip(banks, turns))

    # ------------------------------------------------------------------ retrospective reflection
    def render_memory(self, position: int, entry: MemoryEntry, conversation: Conversation) -> str:
        """Line ``[position] (time) text`` of a shown memory, with its source turns under it when ``show_raw``."""
        line = f"[{position}]" + (f" ({entry.time})" if entry.time else "") + f" {entry.text}"
        if self.show_raw:
            by_id = {t.dia_id: t for s in conversation.sessions for t in s.turns}
            raw = [by_id[i].render() for i in entry.source_ids if i in by_id]
            line += "".join(f"\n    {r}" for r in raw)
        return line

    def answer_is_trained(self) -> bool:
        return self.train_generator

    def show_memories(self, trajectories: list[Trajectory], banks: list[MemoryBank], training: bool) -> list[str]:
        """The ``top_m`` of the ``top_k`` retrieved memories that the reranker keeps (sampled when training).

        ``info["shown_ids"]`` lists them in the reranker's order, ``info["shown_order"][j]`` is the one
        displayed as ``[j + 1]`` (shuffled while training when ``shuffle_shown``), and
        ``info["evidence_rewards"]`` their evidence rewards (None when the question has no evidence).
        """
        device = self.reranker.query_adapter.weight.device
        self._selections, rendered = [], []
        for trajectory, bank in zip(trajectories, banks):
            retrieved = bank.retrieve(trajectory.task.question, self.top_k, self.min_retrieval_score)
            candidates = [e for e, _ in retrieved]
            trajectory.info["candidate_source_ids"] = sorted({s for e in candidates for s in e.source_ids})
            shown: list[MemoryEntry] = []
            selection, conversation = None, conversation_of(trajectory.task)
            if candidates:
                query = self.embedder.embed([trajectory.task.question])[0].to(device)  # [D]
                memories = self.embedder.embed([e.text for e in candidates]).to(device)  # [K, D]
                source = [e.source_ids for e in candidates]
                turns = self.source_turns(query, conversation, source) if self.source_turns else None  # [K]
                scores = self.reranker(query, memories, torch.tensor([s for _, s in retrieved]), turns)  # [K]
                chosen = gumbel_top_m(scores, self.top_m, self.temperature, noise=training and self.gumbel)
                selection, shown = (scores, chosen), [candidates[i] for i in chosen.tolist()]
            self._selections.append(selection)
            record_shown(trajectory, shown)
            order = shown_order(len(shown), training and self.shuffle_shown)
            evidence = trajectory.task.meta.get("evidence") or []
            sources = [e.source_ids for e in shown]
            trajectory.info["shown_order"] = order
            trajectory.info["evidence_rewards"] = evidence_rewards(sources, evidence).tolist() if evidence else None
            lines = [self.render_memory(j + 1, shown[i], conversation) for j, i in enumerate(order)]
            rendered.append("\n".join(lines) or "(no memories)")
        return rendered

    def read_answer(self, trajectory: Trajectory, response: str) -> str:
        """The answer without citations; the cited memories (indices into ``info["shown_ids"]``, mapped
        back through ``info["shown_order"]``) and their citation rewards (+1/−1) go to ``info``."""
        num_shown = len(trajectory.info["shown_ids"])
        order = trajectory.info.get("shown_order") or list(range(num_shown))
        cited = {order[position] for position in parse_citations(response, num_shown)}
        rewards = citation_rewards(cited, num_shown)  # [M], in the reranker's order
        trajectory.info.update(cited=sorted(cited), citation_rewards=rewards.tolist())
        return strip_citations(answer_part(response))

    def rollout(self, engine: RolloutBackend, tasks: list[Task], settings: GenerationSettings) -> list[Trajectory]:
        """The bank workflow's rollout; a training rollout also readies the reranker's loss (:meth:`module_loss`)."""
        trajectories = super().rollout(engine, tasks, settings)
        if settings.temperature > 0:
            self._pending_loss, self._pending_metrics = self._reranker_update(trajectories)
        return trajectories

    def _reranker_update(self, trajectories: list[Trajectory]) -> tuple[Tensor | None, dict[str, float]]:
        """REINFORCE loss of the last selections under the ``reranker_reward``; moves the baseline ``b``."""
        losses, used, citations, group_keys, means, no_evidence = [], [], [], [], [], 0
        for trajectory, selection in zip(trajectories, self._selections):
            citations.append(torch.tensor(trajectory.info["citation_rewards"]))
            reward = trajectory.info["citation_rewards" if self.reranker_reward == "citation" else "evidence_rewards"]
            if reward is None:  # evidence reward for a question without evidence: no signal
                no_evidence += 1
                continue
            rewards = torch.tensor(reward)  # [M]
            if selection is not None and torch.is_grad_enabled():
                scores, chosen = selection
                losses.append(
                    reinforce_loss(selection_log_probs(scores, chosen, self.temperature), rewards, self.baseline)
                )
            used.append(rewards)
            group_keys.append(trajectory.task.id or trajectory.task.question)
            means.append(float(rewards.mean()) if rewards.numel() else 0.0)
        self._selections = []
        flat, cited = (torch.cat(x) if x else torch.zeros(0) for x in (used, citations))
        mean_reward = float(flat.mean()) if flat.numel() else 0.0
        metrics = {
            "reranker/loss": float(torch.stack(losses).detach().mean()) if losses else 0.0,
            "reranker/reward": mean_reward,
            "reranker/citation_reward": float(cited.mean()) if cited.numel() else 0.0,
            "reranker/baseline": self.baseline,
            "reranker/cited_frac": float((cited > 0).float().mean()) if cited.numel() else 0.0,
            "reranker/shown_mean": sum(len(t.info["shown_ids"]) for t in trajectories) / max(len(trajectories), 1),
            "reranker/reward_varied_groups": varied_group_share(group_keys, means),
        }
        if self.reranker_reward == "evidence":
            metrics["reranker/no_evidence"] = float(no_evidence)
        if flat.numel():
            self.baseline = self.baseline_momentum * self.baseline + (1 - self.baseline_momentum) * mean_reward
        return (torch.stack(losses).mean() if losses else None), metrics

    def module_loss(self, rollouts: RolloutBatch) -> Tensor | None:
        """The reranker's REINFORCE loss of the last training rollout (taken: a second call gives None)."""
        loss, self._pending_loss = self._pending_loss, None
        return loss

    def step_metrics(self, rollouts: RolloutBatch) -> dict[str, float]:
        """The reranker's loss, rewards, baseline, cited fraction and shown count of the last training rollout."""
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
