"""Rollouts through LoRA layers over a bf16 (or fp16) base: the adapters' products without peft's path.

A merged weight ``W + scaling * B @ A`` rounded to bf16 loses most of a young adapter's update (bf16
keeps 8 bits of mantissa), so :class:`~lightning_memrl.rollout.merged.MergedAdapters` merges only fp32
bases. Through peft, a bf16 LoRA layer costs about 2.6x its base product at a decode step's few rows
(one SmolLM2 ``q_proj``, 8 rows: 182 against 70 µs), most of it the adapters' small fp32 products,
casts and dispatch. :class:`LowRankStandIn` serves such a layer during a rollout with the same
arithmetic in fewer operations:

    y = round_to_base_dtype( base(x) + (x · Aᵀ) · (scaling · B)ᵀ )      # A, B and the sum in fp32

- the scaling is folded into a copy of ``B`` (one product fewer);
- layers of one parent module with the same input width share one fp32 product ``x · A_allᵀ``
  (:class:`SharedInput`, ``A_all`` the members' ``A`` stacked): the attention's ``q``, ``k`` and ``v``
  are called with the same tensor, and so are the MLP's ``gate`` and ``up``; a member called with
  another input (``o_proj``) computes the group's product afresh (one product either way);
- the base layer stays a registered submodule, so
  :class:`~lightning_memrl.rollout.packed.PackedLinears` serves it from its packed weight.

The sum is formed in fp32 and rounded once, as peft does, so the sampled tokens' log-probs equal the
learner's up to the fp32 rounding of the folded scaling (bit for bit on the tiny test model). With
gradients on, another input dtype, or before :func:`refresh_group`, the stand-in runs the peft layer
itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


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


class LowRankStandIn(nn.Module):
    """Stands in for a peft LoRA layer over a low-precision base: ``base(x) + round((x·Aᵀ)·(s·B)ᵀ)``.

    Args:
        layer: the peft ``lora.Linear`` it stands in for; not registered as a submodule (a module
            walk must not reach its ``lora_A``/``lora_B``), and run as is when the stand-in cannot serve.
        group: the :class:`SharedInput` of the layers of its parent module with the same input width.
    """

    def __init__(self, layer: Any, group: SharedInput) -> None:
        super().__init__()
        self.__dict__["fallback"] = layer
        self.__dict__["group"] = group
        self.base = layer.base_layer  # registered: packed by PackedLinears like any plain layer
        self.columns = slice(0, 0)  # this layer's columns of the group's product
        self.scaled_b: Tensor | None = None  # [out, rank] fp32: the active adapters' scaling * B, side by side

    @property
    def held_mib(self) -> float:
        """Memory this layer's copies hold (its ``scaling * B``), in MiB."""
        return 0.0 if self.scaled_b is None else self.scaled_b.numel() * 4 / 2**20

    def forward(self, x: Tensor) -> Tensor:
        if self.scaled_b is None or torch.is_grad_enabled() or x.dtype != self.base.weight.dtype:
            return self.fallback(x)
        low_rank = F.linear(self.group.product(x)[..., self.columns], self.scaled_b)
        return low_rank.add_(self.base(x)).to(x.dtype)  # summed in fp32, rounded once: peft's arithmetic


@torch.no_grad()
def refresh_group(group: SharedInput, members: list[LowRankStandIn]) -> None:
    """Rebuild the group's stacked ``A`` and every member's ``scaling * B`` from the current adapter weights."""
    stacked, offset = [], 0
    for member in members:
        factors = active_factors(member.fallback)
        rank = sum(a.shape[0] for a, _, _ in factors)
        member.columns = slice(offset, offset + rank)
        offset += rank
        stacked += [a.float() for a, _, _ in factors]
        scaled = [b.float() * scaling for _, b, scaling in factors]
        member.scaled_b = torch.cat(scaled, dim=1) if scaled else None  # None: no adapter, the peft layer serves
    group.a_all = torch.cat(stacked).contiguous() if stacked else None
    group.forget()


def group_key(parent: nn.Module, layer: Any) -> tuple[int, int, torch.device]:
    """Layers that may share an input: the same parent module, input width and device."""
    weight = layer.base_layer.weight
    return id(parent), weight.shape[1], weight.device
