"""RMM's retrospective reflection: the reranker, its selection, the rewards of shown memories, REINFORCE.

The pieces :class:`~lightning_memrl.workflows.rmm.RMMWorkflow` puts together, each a plain function
so that it can be checked by hand:

- :class:`Reranker` scores the retrieved top K, :func:`gumbel_top_m` keeps M of them;
- :func:`shown_order` shuffles the M kept memories before the generator sees them (training), so
  a generator that always cites the first numbers does not reward the reranker's own top picks;
- :func:`citation_rewards` (RMM's reward: +1 cited, −1 not) or :func:`evidence_rewards` (not RMM's:
  +1 when a memory holds one of the question's annotated evidence turns, −1 otherwise) score the
  shown memories, and :func:`reinforce_loss` turns them into the reranker's loss.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

RERANKER_REWARDS = ("citation", "evidence")


class Reranker(nn.Module):
    """Scores ``s_k = (m_k + A_m m_k) · (q + A_q q)``: residual linear adapters, identity at start.

    Two optional terms, not in RMM, each a learned scalar weight (0 at start, so the reranker still starts as
    the identity) on a per-candidate score standardised over the K candidates; neither depends on what one
    conversation is about, so what they learn can carry over to conversations the reranker never saw:

    - ``first_stage_feature``: ``+ w_f · z(f)_k``, ``f`` the first-stage scores (e.g. BM25): how far to trust
      the first stage's order.
    - ``source_turn_feature``: ``+ w_t · z(t)_k``, ``t_k = max_j e(turn_j) · q`` over the memory's source
      dialogue turns (:func:`source_turn_scores`): how well its raw dialogue, not only its summary, matches
      the question. RMM's memories are (topic summary, raw segment) pairs; the adapters see only the summary.

    Each weight is ``feature_lr_scale · θ`` with ``θ`` the stored parameter: Adam moves ``θ`` by about the learning
    rate a step whatever its gradient's size, so the scale is a learning-rate multiplier for the few feature
    weights against the adapters' 2·(D² + D) entries, whose drift otherwise competes with them.

    Args:
        dim: embedding size.
        first_stage_feature: add the learned first-stage term.
        source_turn_feature: add the learned source-turn term.
        feature_lr_scale: the feature weights' learning-rate multiplier.
    """

    def __init__(
        self,
        dim: int,
        first_stage_feature: bool = False,
        source_turn_feature: bool = False,
        feature_lr_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.query_adapter = nn.Linear(dim, dim)
        self.memory_adapter = nn.Linear(dim, dim)
        for layer in (self.query_adapter, self.memory_adapter):  # start as plain dot-product retrieval
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.first_stage_weight = nn.Parameter(torch.zeros(())) if first_stage_feature else None
        self.source_turn_weight = nn.Parameter(torch.zeros(())) if source_turn_feature else None
        self.feature_lr_scale = feature_lr_scale

    def forward(
        self, query: Tensor, memories: Tensor, first_stage: Tensor | None = None, source_turns: Tensor | None = None
    ) -> Tensor:
        """``query`` [D], ``memories`` [K, D], ``first_stage`` and ``source_turns`` scores [K] (used with their
        features) -> scores [K]."""
        q = query + self.query_adapter(query)  # [D]
        m = memories + self.memory_adapter(memories)  # [K, D]
        scores = m @ q  # [K]
        for name, weight, values in (
            ("first-stage", self.first_stage_weight, first_stage),
            ("source-turn", self.source_turn_weight, source_turns),
        ):
            if weight is None:
                continue
            if values is None:
                raise ValueError(f"a Reranker with the {name} feature needs the candidates' {name} scores")
            scores = scores + self.feature_lr_scale * weight * standardised(values.to(scores))
        return scores


def source_turn_scores(query: Tensor, turn_vectors: Sequence[Tensor]) -> Tensor:
    """``t_k = max_j v_kj · query``: each candidate's best-matching source turn -> [K].

    Args:
        query: the question's embedding [D].
        turn_vectors: per candidate, the embeddings of its source turns [T_k, D] (0 rows: ``t_k`` = 0).
    """
    return torch.stack([(v.to(query) @ query).max() if len(v) else query.new_zeros(()) for v in turn_vectors])  # [K]


class SourceTurnScorer:
    """:func:`source_turn_scores` of a question's candidates from the dialogue turns they came from.

    Each turn (``"speaker: text"``) is embedded once per conversation and cached, so the K candidates of
    every later question cost no new embedding of turns already seen.

    Args:
        embedder: the reranker's embedder (``embed(texts) -> [N, D]``).
    """

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder
        self._vectors: dict[tuple[str, str], Tensor] = {}  # (conversation id, dia_id) -> [D]

    def __call__(self, query: Tensor, conversation: Any, sources: Sequence[Sequence[str]]) -> Tensor:
        """``query`` [D], ``conversation`` (a :class:`~lightning_memrl.data.locomo.Conversation`), each
        candidate's source ``dia_id``s -> scores [K]; ids that name no turn of the conversation are ignored."""
        turns = {t.dia_id: t for session in conversation.sessions for t in session.turns}
        missing = sorted(
            {i for ids in sources for i in ids if i in turns and (conversation.id, i) not in self._vectors}
        )
        if missing:
            vectors = self.embedder.embed([f"{turns[i].speaker}: {turns[i].text}" for i in missing])  # [N, D]
            self._vectors.update({(conversation.id, i): v for i, v in zip(missing, vectors)})

        def stacked(ids: Sequence[str]) -> Tensor:  # [T_k, D]
            rows = [self._vectors[(conversation.id, i)] for i in ids if i in turns]
            return torch.stack(rows) if rows else query.new_zeros((0, query.numel()))

        return source_turn_scores(query, [stacked(ids) for ids in sources])


def standardised(values: Tensor) -> Tensor:
    """``(x − mean) / std`` over the last dimension (population std); all zeros when the values are equal."""
    centred = values - values.mean(dim=-1, keepdim=True)
    std = centred.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return torch.where(std > 1e-12, centred / std.clamp_min(1e-12), torch.zeros_like(centred))


def gumbel_top_m(scores: Tensor, m: int, temperature: float, noise: bool = True, generator: Any = None) -> Tensor:
    """Indices [min(m, K)] of the top entries of ``scores / temperature`` (+ Gumbel noise when ``noise``)."""
    logits = scores.detach() / temperature  # [K]
    if noise:
        uniform = torch.rand(logits.shape, generator=generator).clamp(1e-9, 1 - 1e-9).to(logits.device)
        logits = logits - torch.log(-torch.log(uniform))
    return torch.topk(logits, min(m, logits.numel())).indices


def shown_order(num_shown: int, shuffle: bool, generator: torch.Generator | None = None) -> list[int]:
    """Which kept memory each displayed number shows: entry ``j`` is the index (in the reranker's
    order) of the memory displayed as ``[j + 1]``. A random permutation when ``shuffle`` (drawn from
    ``generator``, else torch's global generator, which ``seed_everything`` seeds), else the identity.
    """
    if not shuffle or num_shown < 2:
        return list(range(num_shown))
    return torch.randperm(num_shown, generator=generator).tolist()


def selection_log_probs(scores: Tensor, indices: Tensor, temperature: float) -> Tensor:
    """``log softmax(scores / temperature)`` [K] at the selected ``indices`` -> [M]."""
    return torch.log_softmax(scores / temperature, dim=-1)[indices]


def parse_citations(text: str, num_shown: int) -> set[int]:
    """0-based displayed positions of the memories a response cites (numbers 1..``num_shown``).

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


def evidence_rewards(shown_sources: Sequence[Sequence[str]], evidence: Sequence[str]) -> Tensor:
    """+1 for each shown memory whose source turns include one of ``evidence``, −1 otherwise -> [num_shown].

    A supervised signal from the data's evidence annotations (LoCoMo ``dia_id``s), not RMM's reward.
    """
    wanted = set(evidence)
    return torch.tensor([1.0 if wanted.intersection(sources) else -1.0 for sources in shown_sources])


def reinforce_loss(log_probs: Tensor, rewards: Tensor, baseline: float) -> Tensor:
    """``−Σ_i (r_i − b)·log p_i``: descending it raises the probability of memories with r_i > b."""
    return -((rewards.to(log_probs.device) - baseline) * log_probs).sum()


def varied_group_share(group_keys: Sequence[str], values: Sequence[float]) -> float:
    """Share of the groups (members share a key, at least two of them) whose members' ``values`` differ."""
    groups: dict[str, set[float]] = {}
    sizes: dict[str, int] = {}
    for key, value in zip(group_keys, values):
        groups.setdefault(key, set()).add(round(float(value), 6))
        sizes[key] = sizes.get(key, 0) + 1
    multi = [key for key, size in sizes.items() if size > 1]
    return sum(len(groups[key]) > 1 for key in multi) / len(multi) if multi else 0.0


def strip_citations(answer: str) -> str:
    """The answer without its ``Citations:`` part and bracketed numbers."""
    answer = re.split(r"citations?\s*:", answer, flags=re.IGNORECASE)[0]
    return re.sub(r"\[[\d,\s]+\]", " ", answer).strip()
