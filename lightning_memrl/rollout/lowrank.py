"""Rollouts through LoRA layers over a bf16 (or fp16) base: the adapters' products without peft's path.

A merged weight ``W + scaling * B @ A`` rounded to bf16 loses most of a young adapter's update (bf16
keeps 8 bits of mantissa), so :class:`~lightning_memrl.rollout.merged.MergedAdapters` merges only fp32
bases. Through peft, a bf16 LoRA layer costs about 2.6x its base product at a decode step's few rows
(one SmolLM2 ``q_proj``, 8 rows: 182 against 70 µs), most of it the adapters' small fp32 products,
casts and dispatch. :class:`LowRankStandIn` serves such a layer during a rollout with the same
arithmetic in fewer operations:

    y = round_to_base_dtype( base(x) + (x · Aᵀ) · (scaling · B)ᵀ )      # A, B and the sum in fp32

- the scaling is folded into a copy of ``B`` (one product fewer);
- layers that are called with the same input share one :class:`LowRankGroup`: the attention's ``q``,
  ``k`` and ``v`` (and the MLP's ``gate`` and ``up``, :data:`FUSED_INPUTS`; in other models the layers
  of one parent module with the same input width) compute ``x · A_allᵀ`` once, ``A_all`` the members'
  ``A`` stacked, and its product with the members' ``scaling · B`` placed block-diagonally, one product
  for the group; each member adds its columns to its base product. A member called with another input
  computes the group's products afresh (correct, the work of the group once more);
- when :class:`~lightning_memrl.rollout.packed.PackedLinears` packs the members' base weights as one
  stacked pack (:meth:`LowRankGroup.stack_bases`), the group adds the stacked base product and rounds
  once for all its members, which take their columns;
- the base layer stays a registered submodule, so ``PackedLinears`` serves it from its packed weight.

The sum is formed in fp32 and rounded once, as peft does, so the sampled tokens' log-probs equal the
learner's up to the fp32 rounding of the folded scaling (bit for bit on the tiny test model). With
gradients on, another input dtype, or before :func:`refresh_group`, the stand-in runs the peft layer
itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

FUSED_INPUTS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling linear layers a module calls with the same input (Llama, Qwen2, Mistral and their kin)."""


def active_factors(layer: Any) -> list[tuple[Tensor, Tensor, float]]:
    """``(A, B, scaling)`` of each active adapter of a peft LoRA layer that has one here."""
    return [
        (layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))
        for name in layer.active_adapters
        if name in layer.lora_A
    ]


def _version(x: Tensor) -> int:
    # Inference tensors (``torch.inference_mode``, e.g. ``predict``) keep no version counter; nothing
    # writes a layer's input in place between the layers that read it, so identity stands for them.
    return 0 if x.is_inference() else x._version


class SharedInput:
    """The fp32 product ``x · A_allᵀ`` of a group of layers that may be called with the same input.

    The product of the last input is kept (with a reference to the input, so its identity cannot be
    reused by another tensor) until another input arrives or :meth:`forget` is called.
    """

    def __init__(self) -> None:
        self.a_all: Tensor | None = None  # [sum of ranks, in] fp32
        self._input: Tensor | None = None
        self._version = -1
        self._product: Tensor | None = None  # [..., sum of ranks] fp32

    @property
    def held_mib(self) -> float:
        """Memory the stacked ``A`` holds, in MiB."""
        return 0.0 if self.a_all is None else self.a_all.numel() * 4 / 2**20

    def product(self, x: Tensor) -> Tensor:
        """``x · A_allᵀ`` in fp32, computed once per input tensor."""
        version = _version(x)
        if x is not self._input or version != self._version:
            self._product = self.compute(x)
            self._input, self._version = x, version
        assert self._product is not None
        return self._product

    def compute(self, x: Tensor) -> Tensor:
        """The group's product of a new input."""
        assert self.a_all is not None
        return F.linear(x.to(self.a_all.dtype), self.a_all)

    def forget(self) -> None:
        """Drop the kept input and product (after a rollout)."""
        self._input, self._product, self._version = None, None, -1


class LowRankGroup(SharedInput):
    """The low-rank products of stand-ins called with the same input, computed once per input.

    ``product(x)`` is ``(x · A_allᵀ) · B_allᵀ`` in fp32, ``[..., sum of outputs]``: ``B_all`` holds each
    member's ``scaling · B`` in its own rows and columns (block-diagonal), so one product serves every
    member. With stacked bases (:meth:`stack_bases`) it is the members' whole output instead, ``round(base
    product + low-rank product)``, dropped once every member took its columns.
    """

    def __init__(self) -> None:
        super().__init__()
        self.b_all: Tensor | None = None  # [sum of outputs, sum of ranks] fp32, block-diagonal
        self.members: list[LowRankStandIn] = []
        self.stacked_base: Callable[[Tensor], Tensor] | None = None  # the members' base products side by side
        self._waiting: set[int] = set()

    @property
    def held_mib(self) -> float:
        held = [t for t in (self.a_all, self.b_all) if t is not None]
        return sum(t.numel() * 4 for t in held) / 2**20

    def release(self) -> None:
        """Drop the factors, the members (each member holds its group: no cycle left behind) and any product."""
        self.a_all = self.b_all = self.stacked_base = None
        self.members.clear()
        self.forget()

    def stack_bases(self, stacked_base: Callable[[Tensor], Tensor] | None) -> None:
        """Let the group compute its members' base products at once (``None``: each member its own)."""
        self.stacked_base = stacked_base
        self.forget()

    def compute(self, x: Tensor) -> Tensor:
        assert self.a_all is not None and self.b_all is not None
        self._waiting = set(range(len(self.members)))  # members that have not taken their columns yet
        low_rank = F.linear(F.linear(x.to(self.a_all.dtype), self.a_all), self.b_all)  # [..., sum of outputs]
        if self.stacked_base is None:
            return low_rank
        return low_rank.add_(self.stacked_base(x)).to(x.dtype)  # summed in fp32, rounded once

    def columns_for(self, index: int, x: Tensor) -> Tensor:
        """Member ``index``'s columns of the group's product of ``x``."""
        out = self.product(x)[..., self.members[index].columns]
        self._waiting.discard(index)
        if not self._waiting:  # every member took its columns: a prefill's product of every group is not kept
            self.forget()
        return out


class LowRankStandIn(nn.Module):
    """Stands in for a peft LoRA layer over a low-precision base: ``base(x) + round((x·Aᵀ)·(s·B)ᵀ)``.

    Args:
        layer: the peft ``lora.Linear`` it stands in for; not registered as a submodule (a module
            walk must not reach its ``lora_A``/``lora_B``), and run as is when the stand-in cannot serve.
        group: the :class:`LowRankGroup` of the layers called with the same input.
    """

    def __init__(self, layer: Any, group: LowRankGroup) -> None:
        super().__init__()
        self.__dict__["fallback"] = layer
        self.__dict__["group"] = group
        self.base = layer.base_layer  # registered: packed by PackedLinears like any plain layer
        self.index = len(group.members)
        group.members.append(self)
        self.columns = slice(0, 0)  # this layer's columns of the group's product
        self.ready = False  # refresh_group gave it its factors

    def forward(self, x: Tensor) -> Tensor:
        if not self.ready or torch.is_grad_enabled() or x.dtype != self.base.weight.dtype:
            return self.fallback(x)
        columns = self.group.columns_for(self.index, x)
        if self.group.stacked_base is not None:
            return columns  # the base product is in it, rounded
        return torch.add(columns, self.base(x)).to(x.dtype)  # summed in fp32, rounded once: peft's arithmetic


@torch.no_grad()
def refresh_group(group: LowRankGroup) -> None:
    """Rebuild the group's stacked ``A`` and block-diagonal ``scaling * B`` from the current adapter weights."""
    factors = [active_factors(member.fallback) for member in group.members]
    ranks = [sum(a.shape[0] for a, _, _ in f) for f in factors]  # 0: no adapter here, its columns add nothing
    if not sum(ranks):  # no adapter in the group: every member runs its peft layer
        group.a_all = group.b_all = None
        for member in group.members:
            member.ready = False
        return
    group.a_all = torch.cat([a.float() for f in factors for a, _, _ in f]).contiguous()
    outputs = [member.base.out_features for member in group.members]
    group.b_all = group.a_all.new_zeros(sum(outputs), sum(ranks))
    row = col = 0
    for member, f, rank, out in zip(group.members, factors, ranks, outputs):
        if rank:
            block = torch.cat([b.float() * scaling for _, b, scaling in f], dim=1)  # [out, rank]
            group.b_all[row : row + out, col : col + rank] = block
        member.columns, member.ready = slice(row, row + out), True
        row, col = row + out, col + rank
    group.forget()


def group_key(parent: nn.Module, attr: str, layer: Any) -> tuple[Any, ...]:
    """Layers that share an input: siblings named in one :data:`FUSED_INPUTS` group, else the layers of one
    parent module with the same input width (and device)."""
    weight = layer.base_layer.weight
    named = next((names for names in FUSED_INPUTS if attr in names), None)
    if named is not None and all(hasattr(parent, name) for name in named):
        return id(parent), named, weight.device
    return id(parent), weight.shape[1], weight.device
