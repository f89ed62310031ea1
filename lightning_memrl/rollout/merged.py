"""Rollouts on merged LoRA weights: the adapted model at the cost of the plain one.

Sampling through a peft model pays, at every token and in every adapted layer, two extra small
matrix products and peft's Python dispatch. :class:`MergedAdapters` instead computes, for each
adapted linear layer, the merged weight ``W + scaling * B @ A`` into a buffer of its own, and for
the duration of one ``generate`` puts a plain ``nn.Linear`` over that buffer where the peft layer
sits in its parent module; afterwards the peft layers are put back. The base weights are never
written: no in-place merge and unmerge (whose round trip changes the low bits of the frozen base,
which is also the reference model), so they stay bit for bit, and anything that runs the model
with the adapters disabled (the reference, frozen agents) outside ``generate`` sees the base.

The merged buffers are rebuilt after the weights change: :meth:`MergedAdapters.invalidate` marks
them stale (the rollout engine's ``sync_weights``), and a layer whose adapter or base weight was
changed in place since its merge (``Tensor._version``) is re-merged anyway before it is swapped in.
:meth:`MergedAdapters.release` frees the buffers (after a rollout, so they do not add to the
update's memory); they cost one copy of the adapted layers' weights while a rollout runs. With
``pack_weights`` (the engine's default on CPU) that copy is held only in oneDNN's packed layout: each
layer is merged into one scratch buffer and packed from there into a
:class:`~lightning_memrl.rollout.packed.PackedStandIn`, instead of a merged copy that
:class:`~lightning_memrl.rollout.packed.PackedLinears` would then pack into a second one (the fp32
quickstart's rollout peak: 1792 -> 1390 MiB above the post-import RSS).

A layer is merged when its base is a plain ``nn.Linear`` (not a 4-bit or 8-bit layer: QLoRA's
base cannot hold an exact merged weight) and its active adapters are vanilla LoRA (no DoRA or other variant, no
LoRA bias); other adapted layers keep computing their adapters, so the result stays exact. A
model sharded by FSDP keeps today's path (a merged copy of every gathered layer on every rank would
cost the memory sharding saves). The
sum is formed in fp32 and rounded once to the base weight's dtype: with fp32 weights the rollout
matches the adapted model to float rounding. With a bf16 (or fp16) base the merged weight is
rounded to bf16, which moves the log-probs by more than peft's path does (the tiny model: a largest
rollout/update gap of 6e-3 against 2e-3), so such layers are merged only when asked
(``low_precision``); otherwise they are served by a
:class:`~lightning_memrl.rollout.lowrank.LowRankStandIn`, which adds the adapters' fp32 low-rank
products to the base product in fewer operations than peft's layer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memrl.rollout.lowrank import LowRankGroup, LowRankStandIn, active_factors, group_key, refresh_group
from lightning_memrl.rollout.packed import PackedStandIn, packing_available

log = logging.getLogger(__name__)


@dataclass
class _Target:
    """One adapted linear layer that can be merged, and where it sits."""

    parent: nn.Module
    attr: str
    layer: Any  # peft.tuners.lora.Linear
    plain: nn.Module | None = None  # the stand-in (nn.Linear, PackedStandIn or LowRankStandIn), while held
    low_rank: bool = False  # served by a LowRankStandIn (a low-precision base), not a merged weight
    group: tuple[Any, ...] = ()  # low_rank: the key of its LowRankGroup
    key: tuple[torch.device, torch.dtype] | None = None  # device and dtype of the base it was made for
    signature: tuple[int, ...] | None = None  # versions of the weights it was merged from


def plain_lora(layer: Any) -> bool:
    """A peft LoRA ``Linear`` over a plain, unsharded ``nn.Linear`` with vanilla adapters."""
    from peft.tuners.lora import Linear as LoraLinear

    if type(layer) is not LoraLinear or type(layer.base_layer) is not nn.Linear or layer.fan_in_fan_out:
        return False
    weight = layer.base_layer.weight
    if type(weight.data) is not Tensor or weight.is_meta:  # DTensor (FSDP) or not materialised
        return False
    return not layer.lora_variant and not any(layer.lora_bias.values())


def _is_sharded(model: nn.Module) -> bool:
    """Whether FSDP (``fully_shard`` or the FSDP1 wrapper) manages any part of ``model``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def find_targets(model: nn.Module) -> list[_Target]:
    """The mergeable adapted layers of ``model`` (empty for a model without LoRA)."""
    targets = []
    for name, module in model.named_modules():
        if name and plain_lora(module):
            parent_name, _, attr = name.rpartition(".")
            targets.append(_Target(model.get_submodule(parent_name), attr, module))
    return targets


class MergedAdapters:
    """Swaps merged copies of a peft model's LoRA linear layers in for the duration of a ``generate``.

    Args:
        model: the peft model (its LoRA layers are found once, here).
        low_precision: also merge layers whose base weights are bf16 or fp16 (the merged weight is
            rounded to that dtype); False merges only fp32 bases, where the result is exact, and
            serves the others with :class:`~lightning_memrl.rollout.lowrank.LowRankStandIn`.
        pack_weights: keep the merged weights of CPU layers only packed for oneDNN (see the module
            docstring), where this torch build can pack their dtype.
        batch_size: the number of rows the packed layout is tuned for (a hint; any batch works).
    """

    def __init__(
        self, model: nn.Module, low_precision: bool = False, pack_weights: bool = False, batch_size: int = 8
    ) -> None:
        self.model = model
        self.pack_weights = pack_weights
        self.batch_size = batch_size
        self.targets = find_targets(model)
        for target in self.targets:
            target.low_rank = not low_precision and target.layer.base_layer.weight.dtype != torch.float32
        self._groups: dict[tuple[Any, ...], tuple[LowRankGroup, list[_Target]]] = {}  # low-rank layers by input
        self._buffers: list[Tensor] = []  # one flat buffer per (device, dtype), the merged weights are views
        self._logged = False
        self._sharded: bool | None = None  # decided at the first swap

    def __bool__(self) -> bool:
        return bool(self.targets)

    @property
    def merged_mib(self) -> float:
        """Memory the merged weights hold now, plain or packed, in MiB (0 when released)."""
        plain = sum(b.numel() * b.element_size() for b in self._buffers) / 2**20
        packed = sum(t.plain.packed_mib for t in self.targets if isinstance(t.plain, PackedStandIn))
        return plain + packed + sum(group.held_mib for group, _ in self._groups.values())

    def invalidate(self) -> None:
        """Mark every merged weight stale: the next :meth:`swapped` merges again (call after a weight change)."""
        for target in self.targets:
            target.signature = None

    def release(self) -> None:
        """Free the merged weights; the next :meth:`swapped` rebuilds them."""
        for target in self.targets:
            target.plain, target.signature, target.key = None, None, None
        for group, _ in self._groups.values():
            group.release()  # at once, not when the garbage collector finds the group and its members
        self._buffers = []
        self._groups = {}

    @contextmanager
    def swapped(self) -> Iterator[int]:
        """Inside: every adapted layer that computes its adapters is a plain linear over its merged weight.

        Layers whose adapters are disabled (``disable_adapter()``) or merged by peft, and every layer
        while the model trains with LoRA dropout, are left as they are. Yields how many were swapped.
        """
        if self._sharded is None:  # FSDP wraps the model after the engine is built, before the first rollout
            self._sharded = _is_sharded(self.model)
            if self._sharded and self.targets:
                log.info("a sharded (FSDP) model: rollouts run the LoRA adapters, not merged weights")
        active = [t for t in self.targets if not self._sharded and self._active(t)]
        self._merge(active)
        try:
            for target in active:
                target.parent._modules[target.attr] = target.plain
            yield len(active)
        finally:
            for target in active:
                target.parent._modules[target.attr] = target.layer
            for group, _ in self._groups.values():
                group.forget()  # the last input and its product

    def _active(self, target: _Target) -> bool:
        """Whether the layer's forward now adds its adapters (and does so without dropout)."""
        layer = target.layer
        if layer.disable_adapters or layer.merged:
            return False
        names = [a for a in layer.active_adapters if a in layer.lora_A]
        if not names:
            return False
        dropout = any(isinstance(layer.lora_dropout[a], nn.Dropout) and layer.lora_dropout[a].p > 0 for a in names)
        return not (dropout and layer.training)

    def _merge(self, targets: list[_Target]) -> None:
        """Give every target a merged stand-in from its current weights (only those changed since are redone)."""
        if targets and not self._allocated():
            self._allocate()
        scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # where packed layers are merged, then freed
        stale_groups = set()
        for target in targets:
            signature = _signature(target.layer)
            if signature != target.signature:
                if target.low_rank:
                    stale_groups.add(target.group)
                elif isinstance(target.plain, PackedStandIn):
                    weight = target.layer.base_layer.weight
                    if len(scratch.get(target.key, ())) < weight.numel():
                        scratch[target.key] = torch.empty(weight.numel(), dtype=weight.dtype, device=weight.device)
                    merged = scratch[target.key][: weight.numel()].view_as(weight)
                    _merge_into(target.layer, merged)
                    target.plain.pack(merged, self.batch_size)
                else:
                    _merge_into(target.layer, target.plain.weight)  # the parameter itself: its version counts it
                target.signature = signature
        for key in stale_groups:  # a group's layers share one stacked A: all are rebuilt together
            group, members = self._groups[key]
            refresh_group(group)
            for member in members:
                member.signature = _signature(member.layer)
        if targets and not self._logged:
            self._logged = True
            low_rank = sum(t.low_rank for t in self.targets)
            log.info(
                "LoRA rollouts: %d adapted linear layers on merged weights, %d adding their low-rank products "
                "to a low-precision base; %.1f MiB of copies",
                len(self.targets) - low_rank,
                low_rank,
                self.merged_mib,
            )

    def _allocated(self) -> bool:
        """Whether every target has a stand-in made for its base weight's device and dtype."""
        return all(t.plain is not None and t.key == _key(t.layer.base_layer.weight) for t in self.targets)

    def _allocate(self) -> None:
        """One flat buffer per (device, dtype) holding every target's merged weight, and the stand-ins over it."""
        groups: dict[tuple[torch.device, torch.dtype], list[_Target]] = {}
        for group, _ in self._groups.values():
            group.release()
        self._buffers, self._groups = [], {}
        for target in self.targets:
            weight = target.layer.base_layer.weight
            target.key, target.signature = _key(weight), None
            if target.low_rank:
                target.group = group_key(target.parent, target.attr, target.layer)
                shared, members = self._groups.setdefault(target.group, (LowRankGroup(), []))
                members.append(target)
                target.plain = LowRankStandIn(target.layer, shared)
            elif self._packs(weight):
                target.plain = PackedStandIn(target.layer, target.layer.base_layer.bias)
            else:
                groups.setdefault(target.key, []).append(target)
        for (device, dtype), members in groups.items():
            flat = torch.empty(sum(t.layer.base_layer.weight.numel() for t in members), dtype=dtype, device=device)
            self._buffers.append(flat)
            offset = 0
            for target in members:
                base = target.layer.base_layer
                view = flat[offset : offset + base.weight.numel()].view_as(base.weight)
                offset += base.weight.numel()
                target.plain = _plain_linear(base, view)

    def _packs(self, weight: Tensor) -> bool:
        """Whether a merged weight like ``weight`` is kept only packed."""
        return self.pack_weights and weight.device.type == "cpu" and packing_available(weight.dtype)


def _key(weight: Tensor) -> tuple[torch.device, torch.dtype]:
    return weight.device, weight.dtype


def _plain_linear(base: nn.Linear, weight: Tensor) -> nn.Linear:
    """An ``nn.Linear`` with ``weight`` (no gradient) and the base layer's own bias (shared, never written)."""
    plain = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
    plain.weight = nn.Parameter(weight, requires_grad=False)
    plain.bias = base.bias
    return plain


def _signature(layer: Any) -> tuple[int, ...]:
    """What a merged weight was computed from: the tensors (identity, storage, in-place version) and scalings."""
    tensors = [layer.base_layer.weight]
    for a, b, _ in active_factors(layer):
        tensors += [a, b]
    signature = [id(t) for t in tensors] + [t.data_ptr() for t in tensors] + [t._version for t in tensors]
    return (*signature, hash(tuple(sorted((k, float(v)) for k, v in layer.scaling.items()))))


@torch.no_grad()
def _merge_into(layer: Any, out: Tensor) -> None:
    """``out = W + sum over active adapters of scaling * B @ A``, summed in fp32 and rounded once to ``out``'s dtype."""
    base = layer.base_layer.weight
    acc = out.copy_(base) if out.dtype == torch.float32 else base.float()
    for a, b, scaling in active_factors(layer):
        acc.addmm_(b.to(acc.dtype), a.to(acc.dtype), alpha=scaling)
    if acc is not out:
        out.copy_(acc)
