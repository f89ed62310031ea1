"""The update's LoRA layers over a low-precision base: sibling layers share one fp32 input and one ``A`` product.

peft's LoRA layer computes, for a bf16 base with fp32 adapters (what ``dtype: auto`` gives on CPUs with
bf16 hardware and on GPUs), ``round(base(x) + B(A(float(x))) * scaling)``: every adapted layer casts its
input to fp32 (and autograd keeps that copy for ``A``'s gradient), and multiplies its whole fp32 output
``[tokens, out]`` by the scaling, forward and backward. The attention's ``q``, ``k`` and ``v`` read one
input, as do the MLP's ``gate`` and ``up`` (:data:`~lightning_memrl.rollout.lowrank.FUSED_INPUTS`). Inside
:func:`grouped`, those layers compute

    y_i = round( base_i(x) + ((float(x) · A_allᵀ)[:, cols_i] · scaling_i) · B_iᵀ )

with one cast of ``x`` and one product with ``A_all`` (the members' ``A`` stacked) per group, and the
scaling applied to the rank-r product; other adapted layers (``o``, ``down``) form groups of one. Each
layer's output is the same sum as peft's (bit for bit when the scaling is a power of two, as with SmolLM2's
``lora_alpha`` 32 and r 16), with its own ``B`` and base product; gradients go through autograd. Autograd
keeps three fp32 copies of a decoder layer's hidden-wide inputs instead of six (``tests/test_adapter_groups.py``).
The gradient of the group's input is its members' summed in fp32 and rounded to bf16 once, where peft rounds
each member's before the sum: gradients further back differ by bf16 rounding, no further from an fp32 copy of
the model than peft's. The step times are in the README ("LoRA in the update").

A layer keeps peft's forward when its adapters are disabled (the reference pass) or merged, when a
variant (DoRA), a LoRA bias or a dropout that is active applies, when its base is not a plain
``nn.Linear`` (QLoRA) or is sharded (FSDP), or when its base is fp32 (nothing is cast there, and
peft's path costs the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_memrl.rollout.lowrank import FUSED_INPUTS
from lightning_memrl.rollout.merged import plain_lora


def _plain_lora(layer: Any) -> bool:
    """A peft LoRA ``Linear`` with vanilla adapters over a plain, unsharded low-precision ``nn.Linear``."""
    return plain_lora(layer) and layer.base_layer.weight.dtype != torch.float32


class InputGroup:
    """Sibling LoRA layers called with the same input: its fp32 copy and ``A_all`` product made once per input.

    The product is dropped once every member has taken its columns, so nothing outlives one forward of
    the parent module (a gradient-checkpointed replay computes it anew from the replayed input).
    """

    def __init__(self, layers: list[Any]) -> None:
        self.layers = layers
        self._input: Tensor | None = None
        self._product: Tensor | None = None  # [..., sum of ranks] fp32
        self._columns: list[slice] = []
        self._waiting: set[int] = set()

    def active(self) -> bool:
        """Whether every member now adds exactly one active adapter without dropout (else peft serves all)."""
        for layer in self.layers:
            if layer.disable_adapters or layer.merged or len(self.adapters(layer)) != 1:
                return False
            dropout = layer.lora_dropout[self.adapters(layer)[0]]
            if isinstance(dropout, nn.Dropout) and dropout.p > 0 and layer.training:
                return False
        return True

    @staticmethod
    def adapters(layer: Any) -> list[str]:
        """The names of ``layer``'s active adapters that it has."""
        return [name for name in layer.active_adapters if name in layer.lora_A]

    def columns(self, index: int, x: Tensor) -> Tensor:
        """Member ``index``'s columns of ``float(x) · A_allᵀ``."""
        if x is not self._input or self._product is None:
            weights = [layer.lora_A[self.adapters(layer)[0]].weight for layer in self.layers]
            self._product = F.linear(x.to(weights[0].dtype), torch.cat(weights))  # autograd splits A's gradient
            self._input, self._waiting = x, set(range(len(self.layers)))
            ends = list(accumulate(w.shape[0] for w in weights))
            self._columns = [slice(end - w.shape[0], end) for end, w in zip(ends, weights)]
        product = self._product[..., self._columns[index]]
        self._waiting.discard(index)
        if not self._waiting:
            self.forget()
        return product

    def forget(self) -> None:
        """Drop the held input and product."""
        self._input = self._product = None


def _grouped_forward(layer: Any, group: InputGroup, index: int, peft_forward: Any) -> Any:
    def forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or not group.active():
            return peft_forward(x, *args, **kwargs)
        name = group.adapters(layer)[0]
        result = layer.base_layer(x)
        low_rank = F.linear(group.columns(index, x) * layer.scaling[name], layer.lora_B[name].weight)
        return torch.add(low_rank, result).to(result.dtype)  # summed in fp32, rounded once, as peft does

    return forward


def input_groups(model: nn.Module) -> list[InputGroup]:
    """The LoRA layers :func:`grouped` can serve: siblings named as in ``FUSED_INPUTS`` together, others alone."""
    groups, seen = [], set()
    for module in model.modules():
        for names in FUSED_INPUTS:
            layers = [getattr(module, name, None) for name in names]
            if all(_plain_lora(layer) for layer in layers):
                groups.append(InputGroup(layers))
                seen.update(id(layer) for layer in layers)
    for module in model.modules():
        if _plain_lora(module) and id(module) not in seen:
            groups.append(InputGroup([module]))  # one layer: its scaling still moves to the rank-r product
    return groups


@contextmanager
def grouped(model: nn.Module) -> Iterator[int]:
    """Inside: sibling LoRA layers over a low-precision base share their input's fp32 copy and ``A`` product.

    Yields the number of layers served so (0: a model without such layers, e.g. full fine-tuning).
    """
    groups = input_groups(model)
    layers = [layer for group in groups for layer in group.layers]
    for group in groups:
        for index, layer in enumerate(group.layers):
            layer.forward = _grouped_forward(layer, group, index, type(layer).forward.__get__(layer))
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
        for group in groups:
            group.forget()
