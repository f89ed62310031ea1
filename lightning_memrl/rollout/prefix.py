"""Shared-prompt-prefix utilities, used by the rollout engine and by the learner's forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask`` of shape [B, P]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix is not worth a separate prefill


def _common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest prefix all ``prompts`` share, leaving each at least one token."""
    limit = min(len(p) for p in prompts) - 1
    common = 0
    while common < limit and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common


def shared_prefix_groups(
    prompts: list[list[int]], min_shared: int, labels: list[Any] | None = None
) -> list[tuple[int, list[int]]]:
    """Group prompts that share a prefix of at least ``min_shared`` tokens; each group's prefix is prefilled once.

    With ``labels`` (e.g. the task each prompt belongs to: GRPO group members share their prompt's
    first part, in MemAgent the problem and the chunk) prompts with the same label form a group.
    Without them, consecutive prompts join a group while they keep at least half of its prefix, so
    a chat template's common header alone does not merge two groups. A prefix always leaves at
    least one token of every member's prompt, so each member still has an input to generate from.

    Returns:
        ``(prefix_length, rows)`` per group; a prompt that shares too little is a group of its own.
    """
    candidates: list[list[int]] = []
    if labels is not None:
        by_label: dict[Any, list[int]] = {}
        for row, label in enumerate(labels):
            by_label.setdefault(label, []).append(row)
        candidates = list(by_label.values())
    else:
        for row, prompt in enumerate(prompts):
            if candidates:
                rows = candidates[-1]
                current = _common_prefix([prompts[r] for r in rows])
                joined = _common_prefix([prompts[r] for r in rows] + [prompt])
                if joined >= min_shared and 2 * joined >= current:
                    rows.append(row)
                    continue
            candidates.append([row])
    groups: list[tuple[int, list[int]]] = []
    for rows in candidates:
        length = _common_prefix([prompts[r] for r in rows])
        if len(rows) > 1 and length >= max(min_shared, 1):
            groups.append((length, rows))
        else:
            groups.extend((len(prompts[r]) - 1, [r]) for r in rows)
    return groups
