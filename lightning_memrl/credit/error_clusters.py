"""Error-cluster penalty: failures that repeat an earlier failure's pattern lose reward by how common that pattern is.

MEDS, "The Past Is Not Past: Memory-Enhanced Dynamic Reward Shaping" (Liu et al., arXiv:2604.11297,
code: github.com/Linxi000/MEDS). The paper keeps, per prompt, a memory of its failed rollouts'
internal representations, clusters it with HDBSCAN, and shapes a new failure's reward as
``r̃ = r − min(α·log(|C_k| + 1), β)`` where ``C_k`` is the error cluster it falls in.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.cluster import HDBSCAN
from torch import Tensor

from lightning_memrl.callbacks.base import MemRLCallback
from lightning_memrl.credit.teacher import right_pad, teacher_model
from lightning_memrl.errors import ConfigError, check_option
from lightning_memrl.learner import micro_batches
from lightning_memrl.logprobs import split_head
from lightning_memrl.rewards import ExactMatch, check_answer_pattern
from lightning_memrl.rollout.prefix import left_pad, position_ids
from lightning_memrl.types import RolloutBatch, Trajectory

GROUP_BY_CHOICES = ("task", "all")


def last_hidden_states(model: Any, inputs: dict[str, Tensor]) -> Tensor:
    """The decoder's last hidden state, [B, L, H]: what the LM head reads (after the final norm).

    Through the decoder alone when :func:`~lightning_memrl.logprobs.split_head` can split the head off
    (no vocabulary-sized logits), else ``hidden_states[-1]`` of the model's own forward.
    """
    parts = split_head(model)
    if parts is not None:
        return parts[0](**inputs).last_hidden_state
    return model(**inputs, output_hidden_states=True).hidden_states[-1]


def pooled_hidden_states(
    model: Any, prompts: list[list[int]], responses: list[list[int]], pad_id: int, device: Any, token_budget: int
) -> Tensor:
    """Mean of the last hidden state over each response's tokens, after its prompt, without gradients.

    Rows are laid out ``[pad… prompt][response pad…]`` (as the learner scores them) and run in
    micro-batches of at most ``token_budget`` padded tokens.

    Returns:
        One float32 vector per row, on the CPU.  # [B, H]
    """
    pooled: list[Tensor | None] = [None] * len(prompts)
    with torch.no_grad():
        for idx in micro_batches([len(prompts[i]) + len(responses[i]) for i in range(len(prompts))], token_budget):
            prompt_ids, prompt_mask = left_pad([prompts[i] for i in idx], pad_id)
            response_ids, response_mask = right_pad([responses[i] for i in idx], pad_id)
            attention = torch.cat([prompt_mask, response_mask], dim=1)
            inputs = {
                "input_ids": torch.cat([prompt_ids, response_ids], dim=1).to(device),
                "attention_mask": attention.to(device),
                "position_ids": position_ids(attention).to(device),
                "use_cache": False,
            }
            hidden = last_hidden_states(model, inputs)[:, prompt_ids.shape[1] :].float()  # [b, R, H]
            mask = response_mask.to(hidden.device, torch.float32).unsqueeze(-1)
            means = ((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).cpu()
            for row, i in enumerate(idx):
                pooled[i] = means[row]
    return torch.stack(pooled)  # type: ignore[arg-type]


def density_clusters(vectors: Tensor, min_cluster_size: int = 2, min_samples: int = 1) -> Tensor:
    """HDBSCAN labels of ``vectors`` [n, H] (euclidean), -1 for noise.

    All noise when there are fewer than ``min_cluster_size`` vectors (nothing to cluster).
    """
    if vectors.shape[0] < max(2, min_cluster_size):
        return torch.full((vectors.shape[0],), -1, dtype=torch.long)
    labels = HDBSCAN(min_cluster_size=min_cluster_size, min_samples=min_samples, copy=True).fit_predict(
        vectors.double().numpy()
    )
    return torch.as_tensor(labels, dtype=torch.long)


def cluster_penalty(sizes: Tensor, alpha: float, max_penalty: float) -> Tensor:
    """``min(alpha·ln(|C| + 1), max_penalty)`` for a failure whose cluster holds ``|C|`` remembered failures.

    ``|C| = 0`` (noise, or a pattern not seen before) gives 0.
    """
    sizes = sizes.float()
    return torch.where(sizes > 0, (alpha * torch.log1p(sizes)).clamp(max=max_penalty), torch.zeros_like(sizes))


class ErrorClusterPenalty(MemRLCallback):
    """MEDS's error-cluster penalty (a ``MemRLCallback``, ``on_rewards``).

    As implemented, at each step:

    - failure: a trajectory whose exact-match score of its final answer (:class:`~lightning_memrl.rewards.ExactMatch`
      with ``answer_pattern``; unscored counts as 0) is below ``success_threshold`` (1.0: any miss);
    - its representation ``h``: one batched, gradient-free forward of the trajectory's last turn
      (``prompt_ids + response ids``) through the teacher (the frozen reference, or the LoRA policy with
      its adapters off: :func:`~lightning_memrl.credit.teacher.teacher_model`), the decoder's *last* hidden
      layer (after the final norm, what the LM head reads) mean-pooled over the response tokens, then
      L2-normalised (the paper's code normalises before clustering);
    - the step's failures join a buffer of the last ``buffer_size`` failures (oldest dropped first; a step
      with more failures than that keeps its last ``buffer_size``, the others get no penalty); each
      group of the buffer (same task when ``group_by: task``, the paper's per-prompt memory; the whole
      buffer when ``all``) that changed is clustered again by HDBSCAN (``min_cluster_size``,
      ``min_samples``, euclidean on the unit vectors);
    - a new failure that HDBSCAN puts in cluster ``C`` gets ``p = min(alpha·ln(|C_old| + 1), max_penalty)``,
      ``|C_old|`` the members of ``C`` remembered from earlier steps (a pattern's first occurrences are
      not penalised); noise points and successes get 0;
    - ``rewards[i] −= p_i``, before the advantage estimator.

    Differences from the paper: its feature is a vector of layer-wise logits, here the pooled last hidden
    state; its code labels a new failure by a 3-nearest-neighbour vote among the previous step's labels
    (and a noise-majority vote counts the noise points as a cluster), here by the clustering it joins
    (noise gets nothing). The paper's public recipe does not state ``α``/``β``; the defaults here are ours.

    Args:
        alpha: ``α``, penalty per log of the cluster size.
        max_penalty: ``β``, the penalty's cap.
        buffer_size: failures remembered (across groups); the oldest go first.
        min_cluster_size: HDBSCAN's smallest cluster (the paper's code: 2).
        min_samples: HDBSCAN's neighbourhood for a core point, the point included (the paper's code: 1).
        group_by: ``task`` clusters each task's failures apart (keyed by task id, else question); ``all`` together.
        success_threshold: an exact-match score at least this is a success.
        answer_pattern: regular expression that picks the answer out for the exact match.

    State (checkpointed): the buffer's task keys, vectors and labels. Each rank keeps its own buffer.
    Serves every workflow (it reads each trajectory's last turn); HDBSCAN is scikit-learn's (a dependency).

    Logs ``train/error_clusters/penalty`` (mean penalty per trajectory), ``.../clusters`` (clusters in the
    buffer, over all groups), ``.../buffer`` (failures remembered), ``.../failures`` (this step's) and
    ``.../teacher_seconds``.
    """

    def __init__(
        self,
        alpha: float = 0.1,
        max_penalty: float = 0.5,
        buffer_size: int = 1024,
        min_cluster_size: int = 2,
        min_samples: int = 1,
        group_by: str = "task",
        success_threshold: float = 1.0,
        answer_pattern: str | None = None,
    ) -> None:
        p = "ErrorClusterPenalty."
        check_option(p + "alpha", alpha, 0.0)
        check_option(p + "max_penalty", max_penalty, 0.0)
        check_option(p + "buffer_size", buffer_size, 2)
        check_option(p + "min_cluster_size", min_cluster_size, 2)
        check_option(p + "min_samples", min_samples, 1)
        check_option(p + "success_threshold", success_threshold)
        if group_by not in GROUP_BY_CHOICES:
            raise ConfigError(f"{p}group_by must be one of {', '.join(GROUP_BY_CHOICES)} (got {group_by!r})")
        check_answer_pattern(answer_pattern, p + "answer_pattern")
        self.alpha, self.max_penalty, self.buffer_size = alpha, max_penalty, int(buffer_size)
        self.min_cluster_size, self.min_samples = int(min_cluster_size), int(min_samples)
        self.group_by, self.success_threshold = group_by, success_threshold
        self.exact_match = ExactMatch(answer_pattern=answer_pattern)
        self.keys: list[str] = []  # group key of each remembered failure, oldest first
        self.vectors = torch.empty(0, 0)  # [n, H] unit vectors
        self.labels = torch.empty(0, dtype=torch.long)  # [n] cluster label within its group, -1 noise
        self.teacher_seconds = 0.0

    def key(self, trajectory: Trajectory) -> str:
        """The buffer group a trajectory's failure belongs to."""
        return (trajectory.task.id or trajectory.task.question) if self.group_by == "task" else ""

    def pooled_states(self, module: Any, trajectories: list[Trajectory]) -> Tensor:
        """Teacher's pooled last hidden state of each trajectory's last turn.  # [F, H]"""
        turns = [t.turns[-1] for t in trajectories]
        start = time.perf_counter()
        with teacher_model(module) as model:
            pooled = pooled_hidden_states(
                model,
                [list(turn.prompt_ids) for turn in turns],
                [list(turn.generation.token_ids) for turn in turns],
                module.engine.pad_id,
                module.device,
                module.grpo.micro_batch_tokens,
            )
        self.teacher_seconds = time.perf_counter() - start
        return pooled

    def remember(self, keys: list[str], vectors: Tensor) -> Tensor:
        """Add failures to the buffer, drop the oldest past ``buffer_size``, re-cluster the changed groups.

        Returns:
            For each added failure, how many failures of earlier steps share its cluster (0 for noise).  # [F]
        """
        vectors = F.normalize(vectors.float(), dim=-1)
        if self.vectors.numel() and self.vectors.shape[1] != vectors.shape[1]:
            raise ValueError(
                f"ErrorClusterPenalty: the remembered failures have {self.vectors.shape[1]} features but this "
                f"model's hidden states have {vectors.shape[1]}; the buffer (from a checkpoint?) belongs to "
                "another model: start without it"
            )
        old = len(self.keys)
        all_keys = self.keys + keys
        stacked = torch.cat([self.vectors.reshape(old, -1), vectors]) if old else vectors
        labels = torch.cat([self.labels, torch.full((len(keys),), -1, dtype=torch.long)])
        drop = max(0, len(all_keys) - self.buffer_size)
        changed = set(keys) | set(all_keys[:drop])
        all_keys, stacked, labels, old = all_keys[drop:], stacked[drop:], labels[drop:], old - drop
        for group in changed:
            rows = torch.tensor([i for i, k in enumerate(all_keys) if k == group], dtype=torch.long)
            if rows.numel():
                labels[rows] = density_clusters(stacked[rows], self.min_cluster_size, self.min_samples)
        self.keys, self.vectors, self.labels = all_keys, stacked, labels
        sizes = torch.zeros(len(keys), dtype=torch.long)
        for j in range(len(keys)):
            i = old + j  # where new failure j sits now; < 0: more new failures than buffer_size, it was dropped
            if i >= 0 and labels[i] >= 0:
                same = [r for r in range(max(old, 0)) if all_keys[r] == all_keys[i] and labels[r] == labels[i]]
                sizes[j] = len(same)
        return sizes

    def num_clusters(self) -> int:
        """Clusters in the buffer, counted over all groups."""
        return len({(k, int(label)) for k, label in zip(self.keys, self.labels.tolist()) if label >= 0})

    def on_rewards(self, trainer: L.Trainer, module: L.LightningModule, rollouts: RolloutBatch) -> None:
        trajectories = rollouts.trajectories
        scores = [self.exact_match(t) for t in trajectories]
        failed = [i for i, s in enumerate(scores) if (s or 0.0) < self.success_threshold and trajectories[i].turns]
        penalty = torch.zeros(rollouts.num_trajectories)
        self.teacher_seconds = 0.0
        if failed:
            vectors = self.pooled_states(module, [trajectories[i] for i in failed])
            sizes = self.remember([self.key(trajectories[i]) for i in failed], vectors)
            penalty[failed] = cluster_penalty(sizes, self.alpha, self.max_penalty)
        rollouts.rewards = rollouts.rewards - penalty.to(rollouts.rewards)
        n = rollouts.num_trajectories
        module.log("train/error_clusters/penalty", float(penalty.mean()) if n else math.nan, batch_size=n)
        module.log("train/error_clusters/clusters", float(self.num_clusters()), batch_size=n)
        module.log("train/error_clusters/buffer", float(len(self.keys)), batch_size=n)
        module.log("train/error_clusters/failures", float(len(failed)), batch_size=n)
        module.log("train/error_clusters/teacher_seconds", self.teacher_seconds, batch_size=n)

    def state_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "vectors": self.vectors.clone(), "labels": self.labels.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = list(state_dict.get("keys", []))
        vectors = state_dict.get("vectors", torch.empty(0, 0))
        labels = state_dict.get("labels", torch.empty(0, dtype=torch.long))
        if not (len(keys) == vectors.shape[0] == labels.shape[0]) and keys:
            raise ValueError(
                f"ErrorClusterPenalty: checkpoint buffer is inconsistent ({len(keys)} keys, {vectors.shape[0]} "
                f"vectors, {labels.shape[0]} labels)"
            )
        self.keys, self.vectors, self.labels = keys, vectors.float(), labels.long()
