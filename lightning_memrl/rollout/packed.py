"""Rollouts on CPU with linear weights pre-packed for oneDNN: the decode step's matrix products faster.

A decode step multiplies a handful of rows (one token per conversation) by every weight matrix of
the model; on CPU these products dominate the step (about 80% of a SmolLM2 decode step in
``torch.profiler``). ``nn.Linear`` sends fp32 products to the BLAS library and bf16 ones to oneDNN
with the weight in its plain ``[out, in]`` layout, re-laid-out on every call; at a few rows both run
far below the machine's read bandwidth. oneDNN's own blocked layout, made once by
``torch.ops.mkldnn._reorder_linear_weight`` (what ``torch.compile``'s CPU weight freezing does), lets
the same products run 1.3-2.5x faster (SmolLM2's shapes at 8 rows, one thread).

:class:`PackedLinears` packs every plain ``nn.Linear`` the model runs on CPU (the merged LoRA
stand-ins of :mod:`lightning_memrl.rollout.merged` included, since it is entered after them) and,
for the duration of one ``generate``, routes the layer's forward through
``torch.ops.mkldnn._linear_pointwise`` with the packed weight. Nothing is written to the weights.
A pack is remade after :meth:`PackedLinears.invalidate` (the engine's ``sync_weights``, which the
learner calls after every optimizer step: fused optimizer kernels write the weights without
counting a tensor version) and when its weight was replaced or written in place since (identity,
storage, version: e.g. a new LoRA merge). :meth:`PackedLinears.release` frees the packs after a
rollout, so they do not add to the update's memory; while a rollout runs they cost one copy of the
packed layers' weights. The products are the same sums in another order: logits move by float
rounding (about 6e-5 on SmolLM2 in fp32), well inside the ``logprob_gap`` the learner checks.

Layers of one module that read the same input (:data:`FUSED_INPUTS`: the attention's ``q_proj``,
``k_proj`` and ``v_proj``, the MLP's ``gate_proj`` and ``up_proj``) share one pack of their weights
stacked (:class:`FusedPack`): the first of them to be called computes the stacked product once, the
others take their columns of it. One product of 960 or 3072 columns streams its weight faster than
three or two narrow ones (SmolLM2's shapes at 8 rows, 2 threads: q/k/v 155 -> 100 µs fp32, 83 -> 53 µs
bf16; gate/up 240 -> 217 µs fp32, 146 -> 113 µs bf16). A member called with another input than the
group's last computes the stacked product of that input (correct, one product of work more).

Packed are fp32 weights, and bf16 ones where oneDNN supports bf16 on this CPU
(``torch.ops.mkldnn._is_mkldnn_bf16_supported()``; ``nn.Linear`` computes bf16 through oneDNN
already, so bf16 results are bit for bit the same). A layer on another device, in another dtype,
sharded, or called with gradients on keeps ``nn.Linear``'s own forward, and so do peft's LoRA ``A``
and ``B`` layers (rank-r products that gain nothing and change every step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_memrl.rollout.lowrank import FUSED_INPUTS, LowRankGroup, LowRankStandIn, SharedInput

log = logging.getLogger(__name__)


@cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack a CPU linear weight of ``dtype`` for oneDNN."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(ops._is_mkldnn_bf16_supported())


@dataclass
class _Pack:
    """A layer's packed weight and what it was made from."""

    weight: Tensor  # oneDNN-layout copy of the layer's weight
    signature: tuple[int, int, int]  # (id, data_ptr, _version) of the weight it was packed from


def _signature(weight: Tensor) -> tuple[int, int, int]:
    # Inference tensors (made under ``torch.inference_mode``, e.g. a model loaded for ``predict``)
    # keep no version counter; only code inside inference mode can write them, and nothing there
    # changes weights, so identity and storage stand for them.
    version = 0 if weight.is_inference() else weight._version
    return id(weight), weight.data_ptr(), version


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    weight = module.weight
    return (
        type(weight.data) is Tensor
        and weight.device.type == "cpu"
        and not weight.is_meta
        and weight.dim() == 2
        and packing_available(weight.dtype)
        and (module.bias is None or module.bias.dtype == weight.dtype)
    )


def _adapter_layers(model: nn.Module) -> set[nn.Module]:
    """peft's LoRA ``A`` and ``B`` layers: rank-r products gain nothing from packing and change every step."""
    found: set[nn.Module] = set()
    for module in model.modules():
        for name in ("lora_A", "lora_B"):
            holder = getattr(module, name, None)
            if isinstance(holder, nn.ModuleDict):
                found.update(holder.values())
    return found


def pack_weight(weight: Tensor, batch_size: int) -> Tensor:
    """A copy of a ``[out, in]`` CPU linear weight in oneDNN's blocked layout, tuned for ``batch_size`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size)


def _packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _packed_forward(module: nn.Linear, pack: _Pack) -> Callable[[Tensor], Tensor]:
    """The layer's forward through the packed weight; with gradients on, ``nn.Linear``'s own."""

    def forward(x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.dtype != pack.weight.dtype:
            return F.linear(x, module.weight, module.bias)
        return _packed_linear(x, pack.weight, module.bias)

    return forward


class PackedStandIn(nn.Module):
    """Stands in for an adapted layer during a rollout, computing with a weight held only packed.

    :class:`~lightning_memrl.rollout.merged.MergedAdapters` packs each merged LoRA weight ``W +
    scaling * B @ A`` straight from a scratch buffer into this layer, so a rollout holds one copy
    of the adapted layers' weights (packed) instead of two (merged, then packed). With gradients on
    or another input dtype it runs ``fallback`` (the peft layer: the same function, adapters added).

    Args:
        fallback: the layer it stands in for; not registered as a submodule, so a module walk of the
            model (e.g. :class:`PackedLinears`) does not reach the peft layer's own base layer.
        bias: the base layer's bias (shared, never written), or None.
    """

    def __init__(self, fallback: nn.Module, bias: Tensor | None) -> None:
        super().__init__()
        self.__dict__["fallback"] = fallback
        self.__dict__["bias"] = bias
        self.packed: Tensor | None = None

    def pack(self, weight: Tensor, batch_size: int) -> None:
        """Replace the packed weight by a pack of ``weight`` (which may be reused once this returns)."""
        self.packed = pack_weight(weight, batch_size)

    @property
    def packed_mib(self) -> float:
        """Memory the packed weight holds, in MiB."""
        return 0.0 if self.packed is None else self.packed.numel() * self.packed.element_size() / 2**20

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or torch.is_grad_enabled() or x.dtype != self.packed.dtype:
            return self.fallback(x)
        return _packed_linear(x, self.packed, self.bias)


class FusedPack(SharedInput):
    """One pack of sibling layers' weights stacked (``[sum of outputs, in]``), its product computed once per input.

    Args:
        members: the layers, in the order their weights are stacked (same input width, dtype, device,
            and all with a bias or none).
        batch_size: the number of rows the packed layout is tuned for.
    """

    def __init__(self, members: tuple[nn.Linear, ...], batch_size: int) -> None:
        super().__init__()
        self.packed = pack_weight(torch.cat([m.weight.detach() for m in members]), batch_size)
        biases = [m.bias for m in members]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        self.splits = [m.out_features for m in members]
        self.signature = tuple(_signature(m.weight) for m in members)
        self._waiting: set[int] = set()

    def compute(self, x: Tensor) -> Tensor:
        self._waiting = set(range(len(self.splits)))  # members that have not taken their columns yet
        return _packed_linear(x, self.packed, self.bias)

    def forward_of(self, module: nn.Linear, index: int) -> Callable[[Tensor], Tensor]:
        """Member ``index``'s forward: its columns of the stacked product; with gradients on, its own."""
        start = sum(self.splits[:index])
        end = start + self.splits[index]

        def forward(x: Tensor) -> Tensor:
            if torch.is_grad_enabled() or x.dtype != self.packed.dtype:
                return F.linear(x, module.weight, module.bias)
            columns = self.product(x)[..., start:end]
            self._waiting.discard(index)
            if not self._waiting:  # every member has its columns: the group holds no product between calls
                self.forget()  # (a prefill's product of every layer would otherwise stay alive at once)
            return columns

        return forward


def _stackable(members: tuple[nn.Module, ...], layers: set[nn.Module]) -> bool:
    """Whether ``members`` are all packable ``layers`` of one input width, dtype and device (all biased or none)."""
    if not all(m in layers for m in members):
        return False
    return len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in members}) == 1


def fused_groups(model: nn.Module, layers: set[nn.Module]) -> list[tuple[nn.Linear, ...]]:
    """Sibling layers among ``layers`` named as a :data:`FUSED_INPUTS` group that can share one pack."""
    groups = []
    for module in model.modules():
        for names in FUSED_INPUTS:
            members = tuple(getattr(module, name, None) for name in names)
            if _stackable(members, layers):
                groups.append(members)
    return groups


def low_rank_groups(model: nn.Module, layers: set[nn.Module]) -> dict[tuple[nn.Linear, ...], LowRankGroup]:
    """The base layers of LoRA stand-in groups (:class:`~lightning_memrl.rollout.lowrank.LowRankGroup`) that
    can share one pack, each with its group: every member of the group is in the model now."""
    modules = list(model.modules())
    present = set(modules)
    groups = {id(m.group): m.group for m in modules if isinstance(m, LowRankStandIn) and m.ready}
    found = {}
    for group in groups.values():
        bases = tuple(member.base for member in group.members)
        if len(bases) > 1 and all(m in present and m.ready for m in group.members) and _stackable(bases, layers):
            found[bases] = group
    return found


class PackedLinears:
    """Routes a model's CPU linear layers through oneDNN-packed weights for the duration of a ``generate``.

    Args:
        model: the model ``generate`` runs (a peft model included: its plain linear layers are packed).
        batch_size: the number of rows the packed layout is tuned for (a hint; any batch works).
    """

    def __init__(self, model: nn.Module, batch_size: int = 8) -> None:
        self.model = model
        self.batch_size = batch_size
        self._packs: dict[nn.Linear, _Pack] = {}
        self._fused: dict[tuple[nn.Linear, ...], FusedPack] = {}
        self._logged = False

    @property
    def packed_mib(self) -> float:
        """Memory the packed weights hold now, in MiB (0 when released)."""
        packs = [p.weight for p in self._packs.values()] + [f.packed for f in self._fused.values()]
        return sum(w.numel() * w.element_size() for w in packs) / 2**20

    def invalidate(self) -> None:
        """Mark every pack stale: the next :meth:`swapped` packs again (call after a weight change)."""
        for pack in self._packs.values():
            pack.signature = (0, 0, -1)
        for fused in self._fused.values():
            fused.signature = ()

    def release(self) -> None:
        """Free the packed weights; the next :meth:`swapped` packs again."""
        self._packs, self._fused = {}, {}

    @contextmanager
    def swapped(self) -> Iterator[int]:
        """Inside: every packable ``nn.Linear`` of the model computes with its packed weight. Yields their count."""
        adapters = _adapter_layers(self.model)
        layers = [m for m in self.model.modules() if _packable(m) and m not in adapters]
        low_rank = low_rank_groups(self.model, set(layers))  # LoRA stand-ins: their bases stacked
        groups = fused_groups(self.model, set(layers)) + list(low_rank)
        grouped = {m for members in groups for m in members}
        singles = [layer for layer in layers if layer not in grouped]
        with torch.no_grad():
            for layer in singles:
                self._pack(layer)
            for members in groups:  # one group at a time: a stale pack is freed as its successor is made
                self._fused[members] = self._fused_pack(members)
        self._fused = {members: self._fused[members] for members in groups}
        self._packs = {layer: self._packs[layer] for layer in singles}  # layers gone since (a new merge) drop theirs
        for layer in singles:
            layer.forward = _packed_forward(layer, self._packs[layer])  # an instance attribute shadows the method
        for members, fused in self._fused.items():
            for index, layer in enumerate(members):
                layer.forward = fused.forward_of(layer, index)
        for members, group in low_rank.items():
            group.stack_bases(self._fused[members].compute)
        if layers and not self._logged:
            self._logged = True
            log.info(
                "rollouts run on oneDNN-packed weights: %d linear layers (%d in %d stacked groups), %.1f MiB",
                len(layers),
                len(grouped),
                len(groups),
                self.packed_mib,
            )
        try:
            yield len(layers)
        finally:
            for layer in layers:
                del layer.forward
            for group in low_rank.values():
                group.stack_bases(None)
            for fused in self._fused.values():
                fused.forget()  # the last input and product

    def _fused_pack(self, members: tuple[nn.Linear, ...]) -> FusedPack:
        """The group's pack, remade unless made from the same, unchanged weights."""
        fused = self._fused.get(members)
        if fused is not None and fused.signature == tuple(_signature(m.weight) for m in members):
            return fused
        return FusedPack(members, self.batch_size)

    def _pack(self, layer: nn.Linear) -> None:
        """Pack ``layer``'s weight unless its pack was made from the same, unchanged tensor."""
        signature = _signature(layer.weight)
        pack = self._packs.get(layer)
        if pack is None or pack.signature != signature:
            self._packs[layer] = _Pack(pack_weight(layer.weight, self.batch_size), signature)
