"""Private torch names, each behind a function of ours with a version guard (see ``_compat``).

Append new shims at the end as self-contained blocks: a ``guarded(...)`` declaration,
then the public function that uses it (with its fallback or a clear error).
"""

from __future__ import annotations

from lightning_mgpu._compat import guarded  # noqa: F401


# ---------------------------------------------------------------------------------------
# DDP internals used by strategies/ and tuning/ (bucket sizes, layout, re-wrapping)
# ---------------------------------------------------------------------------------------
import torch as _torch
import torch.distributed as _dist
from torch.nn.parallel import DistributedDataParallel as _DDP

_LOGGING_DATA = guarded(
    "torch.nn.parallel",
    "DistributedDataParallel._get_ddp_logging_data",
    required=False,
    why="the bucket layout DDP rebuilt (sizes and parameter indices) without allocating gradient buffers; "
    "without it bucket_layout is None and bucket_cap_mb='auto' keeps DDP's default",
)


def ddp_rebuilt_buckets(model: _DDP) -> "tuple[list[int], list[list[int]]] | None":
    """(bytes per bucket, reducer parameter indices per bucket) of DDP's rebuilt layout, in launch
    order; None before DDP rebuilt its buckets (third step) or when this torch does not say."""
    read = getattr(model, _LOGGING_DATA.attribute.rsplit(".", 1)[-1], None)
    if read is None:
        return None
    data = read()
    if not data.get("has_rebuilt_buckets"):
        return None
    try:
        sizes = [int(s) for s in str(data["rebuilt_bucket_sizes"]).split(",")]
        indices = [
            [int(i) for i in group.split()] for group in str(data["rebuilt_per_bucket_param_indices"]).split(",")
        ]
    except (KeyError, ValueError):
        return None
    return sizes, indices


_REMOVE_AUTOGRAD_HOOKS = guarded(
    "torch._C._distributed_c10d",
    "Reducer._remove_autograd_hooks",
    required=False,
    why="detach a replaced DDP wrapper's reducer from autograd at once (fallback: it is detached when freed)",
)


def detach_reducer(model: _DDP) -> bool:
    """Stop ``model``'s reducer from seeing later backward passes; True if it could be done now."""
    remove = getattr(model.reducer, _REMOVE_AUTOGRAD_HOOKS.attribute.rsplit(".", 1)[-1], None)
    if remove is None:
        return False
    remove()
    return True


MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_is_full_backward_hook",
)
"""The per-module hook dictionaries ``nn.Module`` keeps (torch >= 2.0)."""
# Instance attributes, so not resolvable on the class: tests/unit/repo/test_compat.py checks a fresh
# module has every one of MODULE_HOOK_DICTS.


def carry_module_hooks(old: _torch.nn.Module, new: _torch.nn.Module) -> None:
    """Give ``new`` the hooks registered on ``old`` itself (not its children).

    The very same dictionaries, so that a handle taken on ``old`` still removes its hook; hooks
    ``new`` already had are kept. Raises ``RuntimeError`` if this torch keeps hooks elsewhere.
    """
    if not hasattr(old, "_forward_hooks"):
        raise RuntimeError(f"torch {_torch.__version__} keeps module hooks differently; lightning_mgpu needs an update")
    for name in MODULE_HOOK_DICTS:
        hooks = getattr(old, name, None)
        if hooks is None:
            continue
        own = getattr(new, name)
        if isinstance(own, dict) and own:
            hooks.update(own)
        setattr(new, name, hooks)


_EXECUTION_ENGINE = guarded(
    "torch.autograd",
    "Variable._execution_engine",
    required=True,
    why="queue a callback that runs when autograd finished the backward graph (DDP does the same)",
)


def queue_autograd_callback(callback: "Callable[[], None]") -> None:
    """Run ``callback`` once the current backward pass has finished (call during a backward)."""
    _torch.autograd.Variable._execution_engine.queue_callback(callback)


_BUCKET_ASSIGNMENT = guarded(
    "torch.distributed",
    "_compute_bucket_assignment_by_size",
    required=False,
    why="DDP's own bucket assignment rule (fallback: tuning.layout.assign_buckets, a Python copy tested against it)",
)


def ddp_bucket_assignment() -> "Callable[..., Any] | None":
    """torch's ``_compute_bucket_assignment_by_size`` (the function DDP's rebuild calls), or None."""
    return getattr(_dist, _BUCKET_ASSIGNMENT.attribute, None)


_POWERSGD_SHOULD_COMPRESS = guarded(
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "_should_compress",
    required=True,
    why="which tensors torch's PowerSGD hook compresses (the layout keeper must follow the hook's own rule)",
)


def powersgd_should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether torch's ``powerSGD_hook`` compresses an n x m matrix at ``rank``."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return bool(powerSGD_hook._should_compress(n, m, rank, min_compression_rate)[0])  # type: ignore[no-untyped-call]


_STATE_DICT_METADATA = guarded(
    "torch.nn",
    "Module.state_dict",
    required=False,
    why="state_dict()'s OrderedDict carries _metadata (per-module versions, e.g. BatchNorm's); copies keep it",
)


def copy_state_dict_metadata(source: object, target: object) -> None:
    """Copy a ``state_dict``'s ``_metadata`` (module versions) onto a copy of it, if it has one."""
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        target._metadata = metadata  # type: ignore[attr-defined]


_MODULE_APPLY = guarded(
    "torch.nn",
    "Module._apply",
    required=True,
    why="move one module's own parameters and buffers (not its children's) the way Module.to does",
)


def apply_to_own_tensors(module: _torch.nn.Module, fn: "Callable[[_torch.Tensor], _torch.Tensor]") -> None:
    """``module.to``-style conversion of ``module``'s own parameters and buffers, children untouched."""
    module._apply(fn, recurse=False)  # type: ignore[no-untyped-call]


from typing import Any, Callable  # noqa: E402  (annotations above are strings)


# ---------------------------------------------------------------------------------------
# BatchNorm's base class: placement/ (the pipeline's model checks, profiling) and the doctor's probes
# ---------------------------------------------------------------------------------------
from torch.nn.modules import batchnorm as _batchnorm_impl  # noqa: E402

_BATCHNORM_BASE = guarded(
    "torch.nn.modules.batchnorm",
    "_BatchNorm",
    required=False,
    why="the base class of every BatchNorm flavour (1d/2d/3d, lazy, SyncBatchNorm); "
    "fallback: PUBLIC_BATCHNORM_TYPES, the public classes",
)

PUBLIC_BATCHNORM_TYPES: "tuple[type[_torch.nn.Module], ...]" = (
    _torch.nn.BatchNorm1d,
    _torch.nn.BatchNorm2d,
    _torch.nn.BatchNorm3d,
    _torch.nn.LazyBatchNorm1d,
    _torch.nn.LazyBatchNorm2d,
    _torch.nn.LazyBatchNorm3d,
    _torch.nn.SyncBatchNorm,
)
"""torch's public BatchNorm classes (what a torch without ``_BatchNorm`` is checked against)."""

BATCHNORM_TYPES: "tuple[type[_torch.nn.Module], ...]" = (
    (getattr(_batchnorm_impl, _BATCHNORM_BASE.attribute),)
    if hasattr(_batchnorm_impl, _BATCHNORM_BASE.attribute)
    else PUBLIC_BATCHNORM_TYPES
)
"""For ``isinstance``: every BatchNorm layer (running statistics over the batch), SyncBatchNorm included."""


def is_batchnorm(module: object) -> bool:
    """Whether ``module`` is a BatchNorm layer of any flavour (1d/2d/3d, lazy, SyncBatchNorm)."""
    return isinstance(module, BATCHNORM_TYPES)


# ---------------------------------------------------------------------------------------
# DistributedDoctor: the rendezvous store its checks meet through, and reentrant checkpoints
# ---------------------------------------------------------------------------------------
import torch.utils.checkpoint as _checkpoint

_DEFAULT_STORE = guarded(
    "torch.distributed.distributed_c10d",
    "_get_default_store",
    required=False,
    why="the default process group's rendezvous store, where DistributedDoctor's ranks meet before a check "
    "(a bounded wait that sees a rank that left); fallback: the check's collective alone, unbounded",
)


def default_group_store() -> "_dist.Store | None":
    """The store the default process group was made with (None: no group, or this torch does not say)."""
    if not (_dist.is_available() and _dist.is_initialized()):
        return None
    get = getattr(_dist.distributed_c10d, _DEFAULT_STORE.attribute, None)
    if get is None:
        return None
    try:
        store = get()
    except (RuntimeError, ValueError, KeyError):
        return None
    return store if isinstance(store, _dist.Store) else None


_CHECKPOINT_NODE = guarded(
    "torch.utils.checkpoint",
    "CheckpointFunction._backward_cls",
    required=False,
    why="the autograd node type of a reentrant checkpoint (fallback: the node's name, 'CheckpointFunctionBackward')",
)
_CHECKPOINT_NODE_TYPE: "type | None" = getattr(
    getattr(_checkpoint, "CheckpointFunction", None), _CHECKPOINT_NODE.attribute.rsplit(".", 1)[-1], None
)


def is_reentrant_checkpoint_node(node: object) -> bool:
    """Whether an autograd graph node is the backward of ``torch.utils.checkpoint``'s reentrant variant
    (``use_reentrant=True``; its recomputation runs its own backward, where DDP sees every parameter's
    gradient a second time)."""
    if _CHECKPOINT_NODE_TYPE is not None:
        return isinstance(node, _CHECKPOINT_NODE_TYPE)
    name = getattr(node, "name", None)
    return callable(name) and name() == "CheckpointFunctionBackward"


# ---------------------------------------------------------------------------------------
# A tensor's version counter: placement/running/recompute.py (activation checkpointing) tells
# whether an input it will recompute from was changed in place since
# ---------------------------------------------------------------------------------------
_TENSOR_VERSION = guarded(
    "torch",
    "Tensor._version",
    required=True,
    why="the version counter of a recomputed unit's inputs: changed in place after its forward, recomputing from "
    "them would silently give other gradients",
)


def tensor_version(tensor: _torch.Tensor) -> int:
    """How many times ``tensor``'s data was changed in place (shared by its views)."""
    return int(tensor._version)


# ---------------------------------------------------------------------------------------
# torch's PowerSGD hook on CPU buckets where a GPU is visible: comm/compression.py
# ---------------------------------------------------------------------------------------
_POWERSGD_MODULE_TORCH = guarded(
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch",
    required=True,
    why="the hooks end with `if torch.cuda.is_available(): torch.cuda.synchronize(device)`, the bucket's device: on "
    'a machine with a GPU a CPU bucket (gloo) fails there with "Expected a cuda device, but got: cpu"; the module\'s '
    "`torch` is given a `cuda.synchronize` that leaves CPU devices alone",
)


class _CudaForPowerSGD:
    """``torch.cuda`` as torch's PowerSGD hooks see it: ``synchronize`` of a non-CUDA device does nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if device is not None and _torch.device(device).type != "cuda":
            return  # a CPU bucket: nothing on a GPU to wait for
        _torch.cuda.synchronize(device)


class _TorchForPowerSGD:
    """``torch`` as torch's PowerSGD hook module sees it: everything, with :class:`_CudaForPowerSGD` as ``cuda``."""

    cuda = _CudaForPowerSGD()

    def __getattr__(self, name: str) -> Any:
        return getattr(_torch, name)


def powersgd_hooks_leave_cpu_buckets_alone() -> None:
    """Let torch's ``powerSGD_hook`` / ``batched_powerSGD_hook`` reduce CPU buckets on a machine that has a GPU
    (they synchronise the bucket's device as if it were always CUDA; see pytorch/pytorch PR 196568, open): once
    per process, idempotent; CUDA buckets are synchronised as before."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if not isinstance(vars(powerSGD_hook).get("torch"), _TorchForPowerSGD):
        powerSGD_hook.torch = _TorchForPowerSGD()  # type: ignore[assignment]  # a stand-in for the module (see the guard above)
