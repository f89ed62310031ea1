"""Scaling out: FSDP2 sharding, FSDP1 policies, sharding-aware clipping and cross-rank helpers.

Two Lightning strategies are supported:

- ``ModelParallelStrategy`` (FSDP2, ``fully_shard``; runs on CPU over gloo as well as on GPUs over
  NCCL). ``MemRLModule.configure_model`` calls :func:`load_sharded`, which loads the weights on
  rank 0 only, builds the other ranks' copies on the meta device, shards every decoder layer and
  then the root, and broadcasts rank 0's weights into the shards.
- ``FSDPStrategy`` (FSDP1, GPU only): :class:`DecoderLayerFSDPStrategy` derives
  ``auto_wrap_policy`` and ``activation_checkpointing_policy`` from the model's decoder-layer class.

Ranks roll out different tasks, so they run different numbers of turns and decoding steps. Under
FSDP2 every forward of a sharded module is a collective, so :func:`unsharded_for_rollout` gathers
the policy once before the rollout and keeps it whole until the update (no collective during
generation), and :func:`equalize_micro_batches` gives every rank the same number of forward and
backward passes in the update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memrl.models import DTYPES

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- ranks
def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and get_world_size() > 1


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size()


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_rank()


def gather_objects(items: list[Any]) -> list[Any]:
    """Concatenate every rank's ``items`` (picklable) in rank order; ``items`` itself on one process."""
    if not is_distributed():
        return list(items)
    gathered: list[list[Any] | None] = [None] * get_world_size()
    torch.distributed.all_gather_object(gathered, list(items))
    return [item for part in gathered for item in (part or [])]


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over all ranks (``value`` on one process)."""
    if not is_distributed():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if _backend_is_nccl() else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def _backend_is_nccl() -> bool:
    return torch.distributed.get_backend() == "nccl"


def equalize_micro_batches(batches: list[list[int]]) -> tuple[list[list[int]], int]:
    """Pad ``batches`` to the largest count over ranks by repeating its last micro-batch.

    Every rank must run the same number of forward/backward passes under FSDP (each one is a
    collective). Returns the padded list and the number of real micro-batches: the caller scales
    the loss of the extra ones by zero. A rank with no micro-batch gets empty ones (``[]``) to
    fill with a placeholder row (``MemRLModule.update`` gives it one before calling this).
    """
    real = len(batches)
    target = max_over_ranks(real)
    return batches + [batches[-1] if batches else []] * (target - real), real


# --------------------------------------------------------------------------- decoder layers
def decoder_layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The transformer-block classes of ``model`` (a transformers model or a peft wrapper of one).

    Read from ``_no_split_modules`` (what transformers keeps whole when splitting a model), else
    the class of the blocks of the longest ``nn.ModuleList``.

    Raises:
        ValueError: no decoder layer was found.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if lists:
            longest = max(lists, key=len)
            classes = {type(block) for block in longest}
    if not classes:
        raise ValueError(
            f"cannot find the decoder-layer class of {type(base).__name__}: it has no _no_split_modules and no "
            "nn.ModuleList of blocks; pass auto_wrap_policy / activation_checkpointing_policy explicitly"
        )
    return tuple(sorted(classes, key=lambda c: c.__name__))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder-layer module of ``model``, in module order."""
    classes = decoder_layer_classes(model)
    return [m for m in model.modules() if isinstance(m, classes)]


# --------------------------------------------------------------------------- FSDP2
def is_fsdp2(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _model_parallel_base() -> type:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy


class FSDP2Strategy(_model_parallel_base()):  # type: ignore[misc]
    """``ModelParallelStrategy`` for pure data parallelism: every process of every node is one FSDP rank.

    ``data_parallel_size`` is the world size (``num_nodes × devices``) and ``tensor_parallel_size``
    1, whatever the node count, so one config runs on 1 or N nodes. Optional FSDP2 mixed
    precision: with ``param_dtype: bfloat16`` the weights stay fp32 in their shards (the
    optimizer's master copy) and are gathered, computed with and generated from in bf16;
    gradients are reduced in ``reduce_dtype``.

    Args:
        param_dtype: dtype weights are gathered in (``bfloat16``, ``float16``); None keeps theirs.
        reduce_dtype: dtype of the gradient reduce-scatter; None uses ``param_dtype``.
        reshard_after_forward: free gathered weights after each forward (True, ZeRO-3) or keep
            them until backward (False, ZeRO-2: more memory, fewer all-gathers).
        **kwargs: passed to ``ModelParallelStrategy`` (``save_distributed_checkpoint``, ``timeout``, ...).
    """

    def __init__(
        self,
        param_dtype: str | None = None,
        reduce_dtype: str | None = "float32",
        reshard_after_forward: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("data_parallel_size", None)
        kwargs.pop("tensor_parallel_size", None)
        super().__init__(data_parallel_size=1, tensor_parallel_size=1, **kwargs)
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ValueError(f"trainer.strategy.init_args.{name} must be one of {sorted(DTYPES)} or null")
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`shard_model` (mixed precision, resharding)."""
        if self.param_dtype is None:
            return {"reshard_after_forward": self.reshard_after_forward}
        from torch.distributed.fsdp import MixedPrecisionPolicy

        reduce = DTYPES[self.reduce_dtype] if self.reduce_dtype else None
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[self.param_dtype], reduce_dtype=reduce)
        return {"reshard_after_forward": self.reshard_after_forward, "mp_policy": policy}


def shard_model(model: nn.Module, mesh: Any, reshard_after_forward: bool = True, mp_policy: Any = None) -> nn.Module:
    """``fully_shard`` every decoder layer of ``model`` and then ``model`` itself; idempotent.

    Args:
        model: a transformers model (or a peft wrapper of one).
        mesh: the 1-D data-parallel device mesh (``module.device_mesh["data_parallel"]``).
        reshard_after_forward: free the gathered weights after each forward (ZeRO-3); False keeps
            them between forward and backward (ZeRO-2, more memory, fewer all-gathers).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (None: compute in the weights' dtype).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_fsdp2(model):
        return model
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy}
    if mp_policy is None:
        kwargs["mp_policy"] = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def load_sharded(load: Callable[[bool], nn.Module], mesh: Any, **shard_kwargs: Any) -> nn.Module:
    """Load a model with one full copy of its weights in host memory, on rank 0, and shard it.

    ``load(empty_weights)`` builds the model: with real weights on rank 0, on the meta device on
    the other ranks. Every rank shards its copy (:func:`shard_model`); the other ranks then
    allocate their shards and receive rank 0's weights (``set_model_state_dict`` with
    ``broadcast_from_rank0``), and buffers that are not in the state dict (rotary tables) are
    broadcast too. Parameters not loaded from disk (LoRA initialisation) thereby come from rank
    0 as well, so every rank starts from the same model. ``shard_kwargs`` go to :func:`shard_model`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = get_rank()
    model = load(rank != 0)
    full_state = model.state_dict() if rank == 0 else {}
    persistent = set(model.state_dict().keys())
    shard_model(model, mesh, **shard_kwargs)
    device = _mesh_device(mesh)
    if rank != 0:
        model.to_empty(device=device)  # allocate this rank's shards; values come from rank 0
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name not in persistent:
                torch.distributed.broadcast(buffer, src=0)
    return model


def _mesh_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded_for_rollout(model: nn.Module) -> Iterator[None]:
    """Gather a ``fully_shard``-ed model once and keep it whole inside the block; no-op otherwise.

    Ranks generate for different tasks, so they run different numbers of forwards; with the
    weights gathered up front no forward issues a collective, and decoding does not all-gather
    the weights at every step. transformers' ``generate`` would otherwise switch itself to
    ``synced_gpus`` (an all-reduce per decoding step) on modules marked FSDP-managed; the mark is
    lifted inside the block. Afterwards every module is resharded and its ``reshard_after_forward``
    restored. Needs memory for one full copy of the weights per device.
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield
        return
    previous = [_reshard_after_forward(m) for m in modules]
    managed = [m for m in model.modules() if getattr(m, "_is_fsdp_managed_module", False)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    for module in managed:
        module._is_fsdp_managed_module = False
    try:
        yield
    finally:
        for module in managed:
            module._is_fsdp_managed_module = True
        for module, value in zip(modules, previous):
            module.reshard()
            module.set_reshard_after_forward(value, recurse=False)


def _reshard_after_forward(module: nn.Module) -> bool:
    groups = module._get_fsdp_state()._fsdp_param_groups
    return bool(groups[0]._reshard_after_forward) if groups else True


def is_unsharded(model: nn.Module) -> bool:
    """True when every FSDP module of ``model`` currently holds its gathered weights."""
    groups = [g for m in _fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    return bool(groups) and all(g.is_unsharded for g in groups)


def allow_classes_of(obj: Any) -> list[type]:
    """Allow-list the classes of the objects inside ``obj`` for ``torch.load(weights_only=True)``.

    A sharded checkpoint's metadata (which holds the module's hyperparameters: settings
    dataclasses, the workflow, reward functions) is read with ``weights_only=True`` by Lightning
    2.6 whatever ``fit(weights_only=...)`` says. The classes of this run's own hyperparameters are
    allowed, so resuming works. Returns the classes added.
    """
    found: set[type] = set()

    def walk(value: Any, depth: int = 0) -> None:
        if depth > 8 or value is None or isinstance(value, (str, bytes, int, float, bool, Tensor)):
            return
        if isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
            found.add(type(value))
            for item in vars(value).values():
                walk(item, depth + 1)

    walk(obj)
    classes = sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    torch.serialization.add_safe_globals(classes)
    return classes


# --------------------------------------------------------------------------- clipping
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float) -> float:
    """Clip the gradients' total 2-norm to ``max_norm`` and return the norm before clipping.

    Works for plain tensors and for FSDP2's sharded ``DTensor`` gradients (the norm is reduced
    over all shards), unlike Lightning's ``clip_gradients`` under FSDP precision.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


# --------------------------------------------------------------------------- FSDP1
def fsdp1_policies(model: nn.Module, activation_checkpointing: bool = False) -> dict[str, Any]:
    """``FSDPStrategy`` keyword arguments that wrap (and optionally checkpoint) each decoder layer.

    Returns ``{"auto_wrap_policy": ModuleWrapPolicy({Layer})}`` plus
    ``"activation_checkpointing_policy": {Layer}`` when ``activation_checkpointing`` is set.
    """
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    classes = set(decoder_layer_classes(model))
    policies: dict[str, Any] = {"auto_wrap_policy": ModuleWrapPolicy(classes)}
    if activation_checkpointing:
        policies["activation_checkpointing_policy"] = classes
    return policies


def _fsdp_strategy_base() -> type:
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy


class DecoderLayerFSDPStrategy(_fsdp_strategy_base()):  # type: ignore[misc]
    """Lightning's ``FSDPStrategy`` (FSDP1, GPUs) wrapping each decoder layer of the policy.

    The policies are derived from the model when it is wrapped (:func:`fsdp1_policies`), so a
    YAML config needs no Python class objects. Explicit ``auto_wrap_policy`` /
    ``activation_checkpointing_policy`` arguments win.

    Args:
        activation_checkpointing: checkpoint every decoder layer (recompute it in backward).
        **kwargs: passed to ``FSDPStrategy`` (``sharding_strategy``, ``cpu_offload``, ...).
    """

    def __init__(self, activation_checkpointing: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint_decoder_layers = activation_checkpointing

    def apply_decoder_layer_policies(self, model: nn.Module) -> None:
        """Fill in the wrap / checkpointing policies from ``model``'s decoder-layer class."""
        from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs

        policies = fsdp1_policies(model, self.checkpoint_decoder_layers)
        self.kwargs.setdefault("auto_wrap_policy", policies["auto_wrap_policy"])
        if "activation_checkpointing_policy" in policies and not self._activation_checkpointing_kwargs:
            self._activation_checkpointing_kwargs = _activation_checkpointing_kwargs(
                None, policies["activation_checkpointing_policy"]
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        self.apply_decoder_layer_policies(model)
        return super()._setup_model(model)
