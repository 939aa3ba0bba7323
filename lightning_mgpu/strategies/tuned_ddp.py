"""``TunedDDPStrategy``: Lightning's DDP with explicit gradient buckets and compression hooks.

Three things stock ``DDPStrategy`` does not do:

* **Buckets you can size without losing the first one.** torch's DDP keeps a small
  1 MiB first bucket (the last layers' gradients, ready first, so communication starts
  early) *only* while ``bucket_cap_mb`` is left at its default: any explicit value
  silently makes every bucket, the first one included, that size. Here
  ``first_bucket_cap_mb`` (default 1 MiB) is kept whatever ``bucket_cap_mb`` is.
* **Compression hooks on every backend.** Lightning registers DDP communication hooks
  only on CUDA; here ``compression="fp16" | "bf16" | "powersgd"`` (or your own
  ``ddp_comm_hook``) is registered on CPU/gloo too.
* **The bucket layout DDP built**, after its rebuild, as :attr:`bucket_layout`.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import math
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.comm.compression import COMPRESSIONS, PrescaledAllreduce, resolve_compression

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_mgpu"
"""Top-level checkpoint key under which the package stores its own state."""

_MIB = 1024 * 1024
DDP_DEFAULT_BUCKET_CAP_MB = float(getattr(torch.nn.parallel.distributed, "_DEFAULT_BUCKET_CAP_MB", 25))
"""torch's default bucket size, used when ``bucket_cap_mb`` is None."""
DEFAULT_FIRST_BUCKET_CAP_MB = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / _MIB
"""torch's first-bucket size (1 MiB), kept by this strategy whatever ``bucket_cap_mb`` is."""

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_DDP_PARAMETERS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
_SUPPORTS_BUCKET_LIST = "bucket_cap_mb_list" in _DDP_PARAMETERS
# Set by the strategy itself, or by Lightning; never accepted from the user.
_RESERVED_DDP_KWARGS = {
    "module": "the strategy wraps your LightningModule itself",
    "device_ids": "the strategy picks the device of each process",
    "output_device": "the strategy picks the device of each process",
    "bucket_cap_mb_list": "use bucket_cap_mb= and first_bucket_cap_mb= instead",
}
_BOOL_DDP_KWARGS = (
    "broadcast_buffers",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "init_sync",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)


@dataclass(frozen=True)
class BucketInfo:
    """One gradient bucket as DDP built it (after its rebuild on the first iteration)."""

    index: int
    """Position in launch order: bucket 0 holds the gradients that are ready first."""
    bytes: int
    """Size of the bucket's flat gradient buffer in bytes."""
    num_params: int
    param_names: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_size_mb(name: str, value: object) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number of MiB or None, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite number of MiB or None, got {value!r}")
    return float(value)


def _check_int(name: str, value: object, minimum: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{why}, got {value!r}")
    return value


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    for key, value in kwargs.items():
        if key in _RESERVED_DDP_KWARGS:
            raise ValueError(f"TunedDDPStrategy does not accept {key}={value!r}: {_RESERVED_DDP_KWARGS[key]}.")
        if key not in _DDP_PARAMETERS:
            allowed = ", ".join(sorted(_DDP_PARAMETERS - set(_RESERVED_DDP_KWARGS) - {"bucket_cap_mb"}))
            raise ValueError(
                f"TunedDDPStrategy got an unknown keyword argument {key}={value!r}. Keyword arguments not named by "
                f"the strategy go to DistributedDataParallel, which accepts: {allowed}."
            )
        if key in _BOOL_DDP_KWARGS and not isinstance(value, bool):
            raise ValueError(f"{key} must be True or False, got {value!r} ({type(value).__name__})")


class TunedDDPStrategy(DDPStrategy):
    """DDP with sized gradient buckets and gradient compression on every backend.

    Args:
        bucket_cap_mb: Size cap of every gradient bucket after the first, in MiB. ``None``
            keeps DDP's default (25 MiB). ``"auto"`` is reserved for bucket-size tuning,
            which is not available yet.
        first_bucket_cap_mb: Size cap of the first bucket (the gradients that are ready
            first), in MiB. ``None`` means 1 MiB, DDP's own default, or ``bucket_cap_mb``
            if that is smaller. Unlike torch's ``bucket_cap_mb=...``, setting
            ``bucket_cap_mb`` here never drops the small first bucket.
        compression: ``None`` (plain all-reduce), ``"fp16"`` or ``"bf16"`` (gradients cast
            for the wire, half the bytes), or ``"powersgd"`` (low-rank compression with
            error feedback). Registered on CPU/gloo as well as CUDA/NCCL.
        powersgd_rank: Matrix approximation rank for PowerSGD (higher: more accurate,
            more bytes).
        powersgd_start_iter: Number of optimizer steps of plain all-reduce before PowerSGD
            takes over (at least 2: DDP rebuilds its buckets on the first step).
        **kwargs: Lightning's ``DDPStrategy`` options (``accelerator``, ``timeout``,
            ``start_method``, ``process_group_backend``, ``ddp_comm_hook``, ...) and every
            other keyword argument of ``DistributedDataParallel`` (``static_graph``,
            ``gradient_as_bucket_view``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: for any argument out of range or of the wrong type, naming it.
        NotImplementedError: for ``bucket_cap_mb="auto"``.

    Example::

        trainer = Trainer(strategy="ddp_tuned", devices=4)
        trainer = Trainer(strategy=TunedDDPStrategy(bucket_cap_mb=50, compression="fp16"), devices=4)
    """

    strategy_name = "ddp_tuned"

    def __init__(
        self,
        bucket_cap_mb: Union[None, float, Literal["auto"]] = None,
        first_bucket_cap_mb: Optional[float] = None,
        compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if bucket_cap_mb == "auto":
            raise NotImplementedError(
                "bucket_cap_mb='auto' (bucket-size tuning) is not available in this version of lightning_mgpu. "
                "Pass a size in MiB, e.g. TunedDDPStrategy(bucket_cap_mb=25), or None for DDP's default."
            )
        self._bucket_cap_mb = _check_size_mb("bucket_cap_mb", bucket_cap_mb)
        self._first_bucket_cap_mb = _check_size_mb("first_bucket_cap_mb", first_bucket_cap_mb)
        if (
            self._bucket_cap_mb is not None
            and self._first_bucket_cap_mb is not None
            and self._first_bucket_cap_mb > self._bucket_cap_mb
        ):
            raise ValueError(
                f"first_bucket_cap_mb ({self._first_bucket_cap_mb:g}) must not exceed bucket_cap_mb "
                f"({self._bucket_cap_mb:g}): the first bucket exists to start communication early."
            )
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if compression is not None and (ddp_comm_hook is not None or ddp_comm_wrapper is not None):
            raise ValueError(
                f"compression={compression!r} registers its own communication hook; pass either compression= or "
                "ddp_comm_hook=/ddp_comm_wrapper=, not both."
            )
        self._compression = compression
        self._powersgd_rank = _check_int("powersgd_rank", powersgd_rank, 1)
        self._powersgd_start_iter = _check_int(
            "powersgd_start_iter", powersgd_start_iter, 2, " (DDP rebuilds its buckets during the first step)"
        )
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
        _check_ddp_kwargs(kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._wire_dtype: Optional[torch.dtype] = None
        self._comm_hook_wrappers: list[Callable[[Callable], Callable]] = []
        self._prescaler: Optional[PrescaledAllreduce] = None

    # ------------------------------------------------------------------ properties

    @property
    def bucket_cap_mb(self) -> float:
        """The bucket size cap in force, in MiB (DDP's default 25 when none was given)."""
        return self._bucket_cap_mb if self._bucket_cap_mb is not None else DDP_DEFAULT_BUCKET_CAP_MB

    @property
    def first_bucket_cap_mb(self) -> float:
        """The first bucket's size cap in force, in MiB."""
        if self._first_bucket_cap_mb is not None:
            return self._first_bucket_cap_mb
        return min(DEFAULT_FIRST_BUCKET_CAP_MB, self.bucket_cap_mb)

    @property
    def compression(self) -> Optional[str]:
        return self._compression

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """Element type of gradients on the wire when a casting hook is on (fp16/bf16), else None."""
        return self._wire_dtype

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments given to ``DistributedDataParallel``, bucket sizes included."""
        return {**self._ddp_kwargs, **self._bucket_kwargs()}

    @property
    def bucket_layout(self) -> Optional[list[BucketInfo]]:
        """Gradient buckets as DDP built them, in launch order; None until DDP recorded them.

        DDP rebuilds its buckets once, at the start of the second training step, from
        the order in which gradients became ready during the first; it records the
        rebuilt layout in its logging data during the third step. This reads that record
        (without allocating any gradient-sized buffer), so it is available from the third
        step on, and after fit.
        """
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            return None
        data = model._get_ddp_logging_data()
        if not data.get("has_rebuilt_buckets"):
            return None
        sizes = [int(s) for s in str(data["rebuilt_bucket_sizes"]).split(",")]
        indices = [[int(i) for i in group.split()] for group in str(data["rebuilt_per_bucket_param_indices"]).split(",")]
        names = _reducer_param_names(model)
        return [
            BucketInfo(index=b, bytes=size, num_params=len(idx), param_names=tuple(names[i] for i in idx))
            for b, (size, idx) in enumerate(zip(sizes, indices, strict=True))
        ]

    # ------------------------------------------------------------------ setup lifecycle

    def _bucket_kwargs(self) -> dict[str, Any]:
        if self._bucket_cap_mb is None and self._first_bucket_cap_mb is None:
            return {}  # DDP's own default: 1 MiB first bucket, then 25 MiB
        if not _SUPPORTS_BUCKET_LIST:
            warnings.warn(
                f"torch {torch.__version__} cannot size the first bucket separately; every bucket, the first "
                f"included, will be {self.bucket_cap_mb:g} MiB. Upgrade to torch >= 2.13 to keep a small first bucket.",
                stacklevel=2,
            )
            return {"bucket_cap_mb": self.bucket_cap_mb}
        # DDP fills bucket 0 up to the first cap, every later one up to the last cap.
        return {"bucket_cap_mb_list": [self.first_bucket_cap_mb, self.bucket_cap_mb]}

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _destroy_process_group_at_exit()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        with _temporarily(self, "_ddp_kwargs", self.ddp_kwargs):
            return super()._setup_model(model)

    @override
    def configure_ddp(self) -> None:
        spec = resolve_compression(
            self._compression,
            backend=self._get_process_group_backend(),
            powersgd_rank=self._powersgd_rank,
            powersgd_start_iter=self._powersgd_start_iter,
        )
        if spec is not None:
            self._ddp_comm_hook, self._ddp_comm_state, self._wire_dtype = spec.hook, spec.state, spec.wire_dtype
        super().configure_ddp()

    def add_comm_hook_wrapper(self, wrapper: Callable[[Callable], Callable]) -> None:
        """Wrap the communication hook DDP will use (the compression hook, or plain
        all-reduce) with ``wrapper(hook) -> hook``; e.g. ``CommProfiler`` times buckets so.

        DDP accepts one hook, registered when the model is wrapped: call this before
        ``fit`` reaches ``strategy.setup`` (a callback's ``setup`` hook is early enough).
        """
        if isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(
                "add_comm_hook_wrapper() was called after DDP registered its communication hook; "
                "call it from a callback's setup() hook, before training starts."
            )
        self._comm_hook_wrappers.append(wrapper)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; DDP supports them on every backend.
        hook, state = self._ddp_comm_hook, self._ddp_comm_state
        if hook is None and self._ddp_comm_wrapper is None and not self._comm_hook_wrappers:
            return  # DDP's built-in C++ all-reduce: the fastest path
        assert isinstance(self.model, DistributedDataParallel)
        if hook is None and self._ddp_comm_wrapper is None:
            # A Python hook only because a wrapper (e.g. CommProfiler) asked for one: keep
            # DDP's averaging all-reduce, with the 1/n on the loss (see pre_backward).
            self._prescaler = PrescaledAllreduce(self.world_size)
            hook, state = self._prescaler.averaging_allreduce, None
        elif hook is None:
            hook, state = default_hooks.allreduce_hook, None
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        for wrapper in self._comm_hook_wrappers:
            hook = wrapper(hook)
        self.model.register_comm_hook(state=state, hook=hook)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._prescaler is not None:
            self._prescaler.prescale(closure_loss)

    # ------------------------------------------------------------------ checkpoints

    def state_for_checkpoint(self) -> dict[str, Any]:
        """What this strategy stores under ``checkpoint["lightning_mgpu"]``."""
        return {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "compression": self._compression,
        }

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        checkpoint.setdefault(CHECKPOINT_KEY, {}).update(self.state_for_checkpoint())
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries: tuple[tuple[str, str, dict[str, Any]], ...] = (
            ("ddp_tuned", "DDP with sized buckets and compression hooks on every backend", {}),
            ("ddp_tuned_spawn", "ddp_tuned, processes started with `spawn`", {"start_method": "spawn"}),
            ("ddp_tuned_fp16", "ddp_tuned with gradients all-reduced in float16", {"compression": "fp16"}),
            ("ddp_tuned_powersgd", "ddp_tuned with PowerSGD gradient compression", {"compression": "powersgd"}),
        )
        for name, description, init_params in entries:
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        layout = self.bucket_layout
        if layout:
            sizes = ", ".join(f"{b.bytes / _MIB:.2f}" for b in layout)
            buckets = "1 gradient bucket" if len(layout) == 1 else f"{len(layout)} gradient buckets"
            rank_zero_info(
                f"{type(self).__name__}: {buckets} of [{sizes}] MiB "
                f"(caps: first {self.first_bucket_cap_mb:g} MiB, then {self.bucket_cap_mb:g} MiB)."
            )
        super().teardown()
        # Wrappers belong to one fit (callbacks add them again in their setup).
        self._comm_hook_wrappers.clear()
        self._prescaler = None
        # The DDP wrapper holds the process group and its gloo threads; freed only at
        # interpreter exit, those threads can abort the process (CPython 3.11 + gloo).
        gc.collect()


_EXIT_HANDLER_REGISTERED = False


def _destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, before it finalizes.

    Lightning keeps the process group after ``fit`` (``trainer.test`` may follow). With gloo
    on CPython 3.11, a process group still alive when the interpreter finalizes can abort
    the process ("terminate called without an active exception": a gloo thread that needs
    the GIL is ``pthread_exit``-ed by the finalizing interpreter). ``atexit`` handlers run
    while Python is still whole, so the group is torn down cleanly there.
    """
    global _EXIT_HANDLER_REGISTERED
    if _EXIT_HANDLER_REGISTERED:
        return
    _EXIT_HANDLER_REGISTERED = True

    def release() -> None:
        gc.collect()  # DDP wrappers in reference cycles hold the group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(release)


def _reducer_param_names(model: DistributedDataParallel) -> list[str]:
    """Names of the parameters in the order DDP's reducer indexes them."""
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    seen: set[int] = set()
    names: list[str] = []
    for module_name, module in model.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                names.append(full)
    return names


@contextmanager
def _temporarily(obj: object, attr: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, saved)
