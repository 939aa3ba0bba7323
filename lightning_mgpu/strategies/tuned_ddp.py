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
* **Bucket sizes found by measuring.** ``bucket_cap_mb="auto"`` tries the sizes that give
  distinct layouts during the first steps of ``fit`` and keeps the fastest
  (:mod:`lightning_mgpu.tuning`); the model is re-wrapped in DDP between optimizer steps,
  its communication hooks (compression, ``CommProfiler``'s timer) and PowerSGD's memory
  carried over.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import math
import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu.comm.compression import COMPRESSIONS, PrescaledAllreduce, resolve_compression
from lightning_mgpu.strategies import _failures
from lightning_mgpu.strategies._rendezvous import rendezvous_store
from lightning_mgpu.tuning import powersgd as powersgd_memory
from lightning_mgpu.tuning.layout import DEFAULT_GRID_MB
from lightning_mgpu.tuning.plan import TuningSettings
from lightning_mgpu.tuning.tuner import DONE, FINAL_STATES, RESUMED, WAITING, BucketTuner, LocalComm, TorchComm, host_clock

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_mgpu"
"""Top-level checkpoint key under which the package stores its own state."""

_MIB = 1024 * 1024
_MAX_SIZE_MB = float(2**40)
"""Largest bucket size accepted, in MiB (1 EiB): DDP counts bucket bytes in 64-bit integers."""
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


def _check_size_mb(name: str, value: object, *, auto: bool = False) -> Optional[float]:
    allowed = "a positive number of MiB, 'auto' or None" if auto else "a positive number of MiB or None"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if not value > _MAX_SIZE_MB and (not math.isfinite(value) or value <= 0):  # (a huge int has no float)
        raise ValueError(f"{name} must be {allowed.replace('a positive', 'a positive, finite')}, got {value!r}")
    if value > _MAX_SIZE_MB:
        raise ValueError(
            f"{name} must be at most {_MAX_SIZE_MB:.0f} MiB (1 EiB; DDP counts bucket bytes in 64-bit integers), "
            f"got {value!r:.40}"
        )
    return float(value)


def _check_int(name: str, value: object, minimum: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{why}, got {value!r}")
    return value


def _check_backend(value: object) -> None:
    if value is None:
        return
    allowed = "a torch.distributed backend name such as 'gloo' or 'nccl' (or None: nccl on GPUs, gloo on CPU)"
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"process_group_backend must be {allowed}, got {value!r}")
    known = {str(name) for name in getattr(torch.distributed.Backend, "backend_list", ())} - {"undefined"}
    # "cpu:gloo,cuda:nccl" names one backend per device type
    unknown = [part.split(":", 1)[-1] for part in value.lower().split(",") if part.split(":", 1)[-1] not in known]
    if known and unknown:
        raise ValueError(f"process_group_backend must be {allowed}; {unknown[0]!r} is not one of {sorted(known)}")


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
            keeps DDP's default (25 MiB). ``"auto"`` measures the sizes that give distinct
            bucket layouts during the first training steps and keeps the fastest (see
            ``tune_*``); afterwards :attr:`bucket_cap_mb` is the size chosen, checkpoints
            carry it and a resumed fit reuses it without tuning again.
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
        timeout: How long a collective (and the start-up rendezvous) may wait for the other
            ranks before it fails, a ``datetime.timedelta`` (default: torch's 30 minutes). A
            rank whose process ends (an exception, ``SIGKILL``, the OOM killer) makes the
            others fail at once, within seconds: its connections close. A rank that hangs
            *without* ending (stuck in Python or I/O, or in a collective the others never
            enter) is noticed only when this timeout runs out, so it bounds how long a hung
            job holds its machines: set it to a few times your slowest step, checkpoint or
            validation, e.g. ``timedelta(minutes=5)``. On CPU/gloo every collective obeys it;
            with NCCL, torch's watchdog enforces it (not exercised by this project's tests).
        **kwargs: Lightning's ``DDPStrategy`` options (``accelerator``,
            ``start_method``, ``process_group_backend``, ``ddp_comm_hook``, ...) and every
            other keyword argument of ``DistributedDataParallel`` (``static_graph``,
            ``gradient_as_bucket_view``, ``find_unused_parameters``, ...).
        tune_steps: With ``"auto"``: the most training steps tuning may take (None: as many
            as 2 rounds of 4 timed steps per distinct layout need, plus the untimed steps
            after each re-wrap). Tuning runs only when the fit has at least 4 times the
            steps it needs left; otherwise DDP's default is kept.
        tune_candidates: With ``"auto"``: the sizes (MiB) to consider; default 1, 2, 4, ...,
            256, and DDP's default 25 is always added. Sizes giving the same layout are
            measured once.
        tune_rounds: With ``"auto"``: how many times each layout is visited (in alternating
            order, so that drift of the machine's speed does not pick the winner).

    Raises:
        ValueError: for any argument out of range or of the wrong type, naming it.

    Example::

        trainer = Trainer(strategy="ddp_tuned", devices=4)
        trainer = Trainer(strategy=TunedDDPStrategy(bucket_cap_mb=50, compression="fp16"), devices=4)
        trainer = Trainer(strategy=TunedDDPStrategy(bucket_cap_mb="auto"), devices=4)
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
        tune_steps: Optional[int] = None,
        tune_candidates: Optional[Sequence[float]] = None,
        tune_rounds: int = 2,
        **kwargs: Any,
    ) -> None:
        self._auto = isinstance(bucket_cap_mb, str) and bucket_cap_mb == "auto"
        self._bucket_cap_mb = None if self._auto else _check_size_mb("bucket_cap_mb", bucket_cap_mb, auto=True)
        self._first_bucket_cap_mb = _check_size_mb("first_bucket_cap_mb", first_bucket_cap_mb)
        self._tuner: Optional[BucketTuner] = None
        if self._auto:
            settings = TuningSettings(
                candidates_mb=DEFAULT_GRID_MB if tune_candidates is None else tune_candidates,  # type: ignore[arg-type]
                steps=tune_steps,
                rounds=tune_rounds,
            )
            self._tuner = BucketTuner(settings, default_mb=DDP_DEFAULT_BUCKET_CAP_MB, first_cap_for=self._first_cap_for)
        else:
            given = {"tune_steps": (tune_steps, None), "tune_candidates": (tune_candidates, None), "tune_rounds": (tune_rounds, 2)}
            for name, (value, default) in given.items():
                if value is not default and (default is None or value != default):
                    raise ValueError(
                        f"{name}={value!r} applies only to bucket_cap_mb='auto' (got bucket_cap_mb={bucket_cap_mb!r}); "
                        f"pass TunedDDPStrategy(bucket_cap_mb='auto', {name}=...) or leave {name} out."
                    )
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
        _check_backend(process_group_backend)
        for name, hook in (("ddp_comm_hook", ddp_comm_hook), ("ddp_comm_wrapper", ddp_comm_wrapper)):
            if hook is not None and not callable(hook):
                raise ValueError(f"{name} must be a callable (a DDP communication hook) or None, got {hook!r}")
        if model_averaging_period is not None:
            _check_int("model_averaging_period", model_averaging_period, 1)
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
        self._comm_hook_wrappers: list[tuple[Callable[[Callable], Callable], bool]] = []  # (wrapper, pausable)
        self._comm_hook_wrappers_on = True
        self._prescaler: Optional[PrescaledAllreduce] = None
        self._powersgd_keeper: Optional[powersgd_memory.PowerSGDLayoutKeeper] = None
        self._pending_powersgd: Optional[dict[str, Any]] = None
        self._extra_ddp_kwargs: dict[str, Any] = {}
        self._at_step_boundary = True
        self.rewraps: list[dict[str, Any]] = []
        """Every re-wrap of this fit (``bucket_cap_mb="auto"``): global step, batch, new size."""

    # ------------------------------------------------------------------ properties

    @property
    def bucket_cap_mb(self) -> float:
        """The bucket size cap in force, in MiB (DDP's default 25 when none was given).

        With ``"auto"``: the size being measured while tuning, the size chosen after it.
        """
        return self._bucket_cap_mb if self._bucket_cap_mb is not None else DDP_DEFAULT_BUCKET_CAP_MB

    @property
    def first_bucket_cap_mb(self) -> float:
        """The first bucket's size cap in force, in MiB."""
        return self._first_cap_for(self.bucket_cap_mb)

    def _first_cap_for(self, bucket_cap_mb: float) -> float:
        first = self._first_bucket_cap_mb if self._first_bucket_cap_mb is not None else DEFAULT_FIRST_BUCKET_CAP_MB
        if not _SUPPORTS_BUCKET_LIST and not (self._bucket_cap_mb is None and self._first_bucket_cap_mb is None):
            return bucket_cap_mb  # old torch: one size for every bucket (see _bucket_kwargs)
        return min(first, bucket_cap_mb)

    @property
    def auto(self) -> bool:
        """True for ``bucket_cap_mb="auto"``."""
        return self._auto

    @property
    def tuning_status(self) -> Optional[str]:
        """With ``"auto"``: ``"waiting"``, ``"observing"``, ``"measuring"``, then ``"done"``,
        ``"skipped"`` (DDP's default kept), ``"resumed"`` (size from a checkpoint) or
        ``"unfinished"`` (the fit ended first); None otherwise. Cheap: read it every step."""
        return None if self._tuner is None else self._tuner.status

    @property
    def tuning(self) -> Optional[dict[str, Any]]:
        """With ``"auto"``: the search as plain data (status, chosen size, the candidates'
        layouts and median step times); None otherwise. Stored in checkpoints."""
        return None if self._tuner is None else self._tuner.record()

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
            return {}  # DDP's own default: 1 MiB first bucket, then 25 MiB (also "auto" before it decides)
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
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        launcher = self._launcher
        if type(launcher) is _MultiProcessingLauncher:  # spawn / fork: bring the tuned size home
            self._launcher = _TunedMultiProcessingLauncher(self, start_method=self._start_method)
        elif type(launcher) is _SubprocessScriptLauncher:  # `python train.py`: check the model before starting ranks
            self._launcher = _CheckedSubprocessScriptLauncher(
                self, launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
            )

    def _check_model(self, model: "pl.LightningModule") -> None:
        """Checks of the arguments that need the LightningModule. Lightning's own launchers run them in
        the launching process before they start the other ranks, so that a mistake is one clear error
        rather than one traceback per rank (each rank checks again at setup). Subclasses extend it."""

    def _process_group_device(self) -> Optional[torch.device]:
        """The device NCCL binds its communicator to (``init_process_group(device_id=...)``); None on CPU.
        A strategy whose process spans several GPUs returns None: a bound NCCL group refuses
        collectives on any other device."""
        return self.root_device if self.root_device.type != "cpu" else None

    @override
    def setup_distributed(self) -> None:
        # DDPStrategy.setup_distributed, with a rendezvous that listens on the loopback interface
        # only when every rank runs on this machine, and survives torchrun's restarts
        # (strategies/_rendezvous.py).
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        kwargs["device_id"] = self._process_group_device()
        store = rendezvous_store(
            self.cluster_environment, self.global_rank, self.world_size, self._timeout, self._process_group_backend
        )
        if store is not None:
            kwargs["store"] = store
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        _destroy_process_group_at_exit()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        with _temporarily(self, "_ddp_kwargs", {**self.ddp_kwargs, **self._extra_ddp_kwargs}):
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

    def add_comm_hook_wrapper(self, wrapper: Callable[[Callable], Callable], *, pausable: bool = False) -> None:
        """Wrap the communication hook DDP will use (the compression hook, or plain
        all-reduce) with ``wrapper(hook) -> hook``; e.g. ``CommProfiler`` times buckets so.

        DDP accepts one hook, registered when the model is wrapped: call this before
        ``fit`` reaches ``strategy.setup`` (a callback's ``setup`` hook is early enough).
        A ``pausable`` wrapper is one that :meth:`set_comm_hook_wrappers` may switch off
        between steps: DDP then runs the hook it wraps, as if it were not there.
        """
        if isinstance(self.model, DistributedDataParallel):
            raise RuntimeError(
                "add_comm_hook_wrapper() was called after DDP registered its communication hook; "
                "call it from a callback's setup() hook, before training starts."
            )
        self._comm_hook_wrappers.append((wrapper, pausable))

    @property
    def has_own_comm_hook(self) -> bool:
        """True when DDP runs a Python communication hook whatever the pausable wrappers
        (compression, ``ddp_comm_hook``, ``ddp_comm_wrapper``, a wrapper that is not pausable);
        False when without them it would use its built-in C++ all-reduce."""
        return (
            self._compression is not None  # its hook is set when DDP is configured
            or self._ddp_comm_hook is not None
            or self._ddp_comm_wrapper is not None
            or any(not pausable for _, pausable in self._comm_hook_wrappers)
        )

    @property
    def comm_hook_wrappers_on(self) -> bool:
        """Whether the pausable wrappers (:meth:`add_comm_hook_wrapper`) are switched on."""
        return self._comm_hook_wrappers_on

    def set_comm_hook_wrappers(self, on: bool) -> bool:
        """Switch the pausable wrappers added by :meth:`add_comm_hook_wrapper` on or off, between
        optimizer steps; e.g. ``CommProfiler`` profiles a window of steps so.

        DDP cannot unregister a hook. With a Python hook in any case (:attr:`has_own_comm_hook`)
        the wrappers stay registered behind a gate that calls the hook they wrap while they are
        off. Otherwise the model is re-wrapped in a new DDP (no weight broadcast), which runs
        DDP's built-in C++ all-reduce while the wrappers are off and the timed hook when they
        are on. Like any new DDP wrapper, the new one uses its initial bucket layout for one step
        and rebuilds it at the start of the next. Returns whether the wrappers are now ``on`` as
        asked; False (nothing changed) while ``bucket_cap_mb="auto"`` is still measuring, so that
        every candidate is timed with the same hook, and when this torch's DDP cannot be built
        without broadcasting the weights again (no ``init_sync``).
        """
        if on == self._comm_hook_wrappers_on:
            return True
        if self._tuner is not None and self._tuner.active:
            return False
        pausable = any(p for _, p in self._comm_hook_wrappers)
        rewrap = pausable and not self.has_own_comm_hook and isinstance(self.model, DistributedDataParallel)
        if rewrap and "init_sync" not in _DDP_PARAMETERS:
            return False
        self._comm_hook_wrappers_on = on
        if rewrap:
            self._rewrap_ddp()
        return True

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; DDP supports them on every backend.
        hook, state = self._ddp_comm_hook, self._ddp_comm_state
        # Pausable wrappers leave DDP only when that gives back the built-in all-reduce;
        # under a Python hook that stays anyway, they are gated instead (see _gated).
        keep_all = self._comm_hook_wrappers_on or self.has_own_comm_hook
        wrappers = [(wrapper, pausable) for wrapper, pausable in self._comm_hook_wrappers if keep_all or not pausable]
        self._prescaler = None
        if hook is None and self._ddp_comm_wrapper is None and not wrappers:
            return  # DDP's built-in C++ all-reduce: the fastest path
        assert isinstance(self.model, DistributedDataParallel)
        if hook is None and self._ddp_comm_wrapper is None:
            # A Python hook only because a wrapper (e.g. CommProfiler) asked for one: keep
            # DDP's averaging all-reduce, with the 1/n on the loss (see pre_backward).
            self._prescaler = PrescaledAllreduce(self.world_size)
            hook, state = self._prescaler.averaging_allreduce, None
        elif hook is None:
            hook, state = default_hooks.allreduce_hook, None
        hook_is_powersgd = hook in (powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook)
        if hook is powerSGD_hook.powerSGD_hook and powersgd_memory.supports(state):
            # PowerSGD's memory is kept per bucket number: remap it when the layout changes
            # (DDP's rebuild, a re-wrap by "auto", a resume). Innermost: it must see the
            # buckets exactly as PowerSGD does.
            if self._powersgd_keeper is None or self._powersgd_keeper.state is not state:
                self._powersgd_keeper = powersgd_memory.PowerSGDLayoutKeeper(state, _reducer_named_params(self.model))
                self._restore_powersgd()
            hook = self._powersgd_keeper.wrap(hook)
        if hook_is_powersgd and self._get_process_group_backend() == "gloo":
            hook = powersgd_memory.one_bucket_at_a_time(hook)
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        gate = self.has_own_comm_hook  # otherwise pausing re-wraps DDP: no gate on the hot path
        for wrapper, pausable in wrappers:
            hook = self._gated(wrapper, hook) if pausable and gate else wrapper(hook)
        self.model.register_comm_hook(state=state, hook=hook)

    def _gated(self, wrapper: Callable[[Callable], Callable], hook: Callable) -> Callable:
        """``wrapper(hook)`` while the pausable wrappers are on, ``hook`` itself while they are off."""
        wrapped = wrapper(hook)
        strategy = self

        # No annotations: this module's are strings, and DDP rejects a hook annotated so.
        def gate(state, bucket):  # type: ignore[no-untyped-def]
            return (wrapped if strategy._comm_hook_wrappers_on else hook)(state, bucket)

        gate.__name__ = gate.__qualname__ = getattr(wrapped, "__name__", "hook")  # DDP logs the hook's name
        return gate

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._prescaler is not None:
            self._prescaler.prescale(closure_loss)

    # ------------------------------------------------------------------ bucket-size tuning

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._at_step_boundary = True
        self.rewraps = []
        tuner = self._tuner
        if tuner is None or tuner.status != WAITING:
            if tuner is not None and tuner.status == RESUMED:
                rank_zero_info(f"{type(self).__name__}: {tuner.summary()}")
            return
        module = self.lightning_module
        assert module is not None
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        tuner.comm = TorchComm(self.root_device) if distributed else LocalComm()
        tuner.clock = host_clock(self.root_device)
        if not isinstance(self.model, DistributedDataParallel):
            tuner.skip(f"the model is wrapped in {type(self.model).__name__}, not DistributedDataParallel")
        elif not module.automatic_optimization:
            tuner.skip("manual optimization: the strategy cannot tell where an optimizer step ends")
        else:
            tuner.begin([param for _, param in _reducer_named_params(self.model)], remaining_steps=self._steps_left())
        if tuner.status in FINAL_STATES:
            rank_zero_info(f"{type(self).__name__}: {tuner.summary()}")

    def _steps_left(self) -> Optional[float]:
        """Optimizer steps this fit still has to run (None: unknown, e.g. an endless loader)."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:  # Lightning cannot tell (no length, no max_steps): assume a long run
            return None
        return None if math.isinf(total) else total - trainer.global_step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._at_step_boundary:  # the first batch of an optimizer step (of an accumulation window)
            self._at_step_boundary = False
            if self._tuner is not None and self._tuner.active:
                self._tuner.window_start()

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._at_step_boundary = True
        tuner = self._tuner
        if tuner is not None and tuner.active:
            # Every rank is here after the same step, with no gradient half-accumulated:
            # the one place where the layout may change.
            size = tuner.step_end(self._built_bucket_bytes)
            if size is not None:
                self._rewrap(size)
            if not tuner.active:
                self._report_tuning()
        return output

    def _built_bucket_bytes(self) -> Optional[tuple[int, ...]]:
        layout = self.bucket_layout
        return None if layout is None else tuple(b.bytes for b in layout)

    def _rewrap(self, bucket_cap_mb: float) -> None:
        """Wrap the LightningModule in a new DDP with ``bucket_cap_mb``, hooks carried over."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        previous, self._bucket_cap_mb = self._bucket_cap_mb, bucket_cap_mb
        try:
            self._rewrap_ddp()
        except BaseException:
            self._bucket_cap_mb = previous
            raise
        self.rewraps.append(
            {
                "global_step": trainer.global_step,
                "batches_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                "bucket_cap_mb": bucket_cap_mb,
            }
        )

    def _rewrap_ddp(self) -> None:
        """Replace the DDP wrapper by a new one built from the current settings, hooks carried over."""
        module = self.lightning_module
        assert module is not None
        epoch_loop = module.trainer.fit_loop.epoch_loop
        if epoch_loop._should_accumulate():  # callers re-wrap after an optimizer step; never risk it
            raise RuntimeError(
                f"{type(self).__name__}: refusing to re-wrap the model inside a gradient-accumulation window "
                f"(global step {module.trainer.global_step}); please report this."
            )
        old = self.model
        assert isinstance(old, DistributedDataParallel)
        remove_hooks = getattr(old.reducer, "_remove_autograd_hooks", None)
        if remove_hooks is not None:
            remove_hooks()  # the old reducer must not see the next backward
        if self._powersgd_keeper is None and powersgd_memory.reset_bucket_memory(self._ddp_comm_state):
            warnings.warn(
                "bucket_cap_mb='auto' re-wrapped the model: the PowerSGD memory of this hook is kept per bucket "
                "number and cannot be remapped (batch_tensors_with_same_shape=True or batched_powerSGD_hook), so "
                "its error feedback and warm start were reset.",
                stacklevel=2,
            )
        # Parameters are already equal on every rank: no broadcast of the weights again.
        extra = {"init_sync": False} if "init_sync" in _DDP_PARAMETERS else {}
        with _temporarily(self, "_extra_ddp_kwargs", extra):
            new = self._setup_model(module)
        _carry_module_hooks(old, new)  # e.g. CommProfiler's forward hook on the wrapper
        self.model = new
        self._register_ddp_hooks()
        # The old wrapper sits in reference cycles (frames kept by its constructor), freed only
        # by a full gc.collect() (~0.25 s in a Lightning process). Its reducer (the gradient
        # buckets: as much memory as the gradients) is not in them: dropping the wrapper's
        # references frees it now.
        for name in ("logger", "reducer"):
            if name in old.__dict__:
                delattr(old, name)

    def _report_tuning(self) -> None:
        tuner = self._tuner
        assert tuner is not None
        rank_zero_info(f"{type(self).__name__}: {tuner.summary()}")
        module = self.lightning_module
        if tuner.status != DONE or module is None or not self.is_global_zero:
            return
        metrics: dict[str, float] = {"tuning/bucket_cap_mb": self.bucket_cap_mb}
        index = tuner.chosen_index
        if index is not None:
            metrics["tuning/step_ms"] = tuner.results[index].step_ms
            default = next((r for r in tuner.results if r.candidate.is_default), None)
            if default is not None:
                metrics["tuning/default_step_ms"] = default.step_ms
        if tuner.gain is not None:
            metrics["tuning/gain_vs_default"] = tuner.gain
        for logger in module.trainer.loggers:
            logger.log_metrics(metrics, step=module.trainer.global_step)

    # ------------------------------------------------------------------ checkpoints

    def state_for_checkpoint(self) -> dict[str, Any]:
        """What this strategy stores under ``checkpoint["lightning_mgpu"]`` (plain types only).

        With ``"auto"``, also ``"tuning"``: the search's record (:attr:`tuning`).
        """
        state: dict[str, Any] = {
            "bucket_cap_mb": self.bucket_cap_mb,
            "first_bucket_cap_mb": self.first_bucket_cap_mb,
            "compression": self._compression,
        }
        if self._tuner is not None:
            state["tuning"] = self._tuner.record()
        return state

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        package = checkpoint.setdefault(CHECKPOINT_KEY, {})
        package.update(self.state_for_checkpoint())
        if self._powersgd_keeper is not None:
            package["powersgd"] = self._gather_powersgd_state()  # a collective: every rank is here
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Never unpickle arbitrary objects unless asked to (fit(..., weights_only=False)): torch before
        # 2.6, or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, would otherwise run code stored in the file.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)
        package = checkpoint.get(CHECKPOINT_KEY)
        if isinstance(package, dict):
            self._restore_package_state(package)
        return checkpoint

    def _restore_package_state(self, package: dict[str, Any]) -> None:
        """Before ``setup``: a tuned bucket size (reused, no tuning) and PowerSGD's memory."""
        tuner = self._tuner
        record = package.get("tuning")
        if tuner is not None and tuner.status == WAITING and isinstance(record, dict):
            size = package.get("bucket_cap_mb")
            valid = isinstance(size, (int, float)) and not isinstance(size, bool) and math.isfinite(size) and size > 0
            if record.get("status") in (DONE, RESUMED) and valid:
                tuner.resume(float(size), record)
                self._bucket_cap_mb = float(size)
            # Saved before the search finished: search again (the steps are ordinary ones).
        saved = package.get("powersgd")
        if isinstance(saved, dict):
            self._pending_powersgd = saved

    def _gather_powersgd_state(self) -> dict[str, Any]:
        keeper = self._powersgd_keeper
        assert keeper is not None
        state = keeper.state_dict()
        error = state.pop("error")
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, error)
        else:
            gathered = [error]
        # Each rank's residual is its own; Q and the counters are the same everywhere.
        return {**state, "world_size": self.world_size, "error_per_rank": gathered}

    def _restore_powersgd(self) -> None:
        saved, keeper = self._pending_powersgd, self._powersgd_keeper
        if saved is None or keeper is None:
            return
        self._pending_powersgd = None
        per_rank = saved.get("error_per_rank") or []
        error = None
        if saved.get("world_size") == self.world_size and self.global_rank < len(per_rank):
            error = per_rank[self.global_rank]
        else:
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint's PowerSGD error feedback comes from {saved.get('world_size')} "
                f"processes, this run has {self.world_size}; it starts again from zero."
            )
        rejected = keeper.load_state_dict(saved, error)
        if rejected:
            rank_zero_warn(
                f"{type(self).__name__}: PowerSGD memory for {len(rejected)} parameter(s) did not match this model "
                f"and was dropped (e.g. {rejected[0]!r})."
            )

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

    # ------------------------------------------------------------------ failures

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # Name the lost ranks in the error, and leave no child rank behind (strategies/_failures.py).
        children = _failures.launched_children(self.launcher, self.global_rank)
        note = _failures.explain_collective_failure(
            exception, rank=self.global_rank, timeout=self._timeout, children=children
        )
        if note is not None and children:
            # Lightning's child-process watcher (it polls every 5 s) SIGKILLs this launching process
            # when it sees a dead child, possibly before the traceback is printed: say it now too.
            print(note, file=sys.stderr, flush=True)
        _failures.reap_children_at_exit(children)

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        tuner = self._tuner
        if tuner is not None and tuner.active:  # the fit ended (or failed) before the search did
            tuner.abandon(f"the fit ended after {tuner.steps_taken} tuning step(s)")
            rank_zero_info(f"{type(self).__name__}: {tuner.summary()}")
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
        self._comm_hook_wrappers_on = True
        self._prescaler = None
        # The PowerSGD keeper stays: a checkpoint saved after fit still carries its memory.
        # The DDP wrapper holds the process group and its gloo threads; freed only at
        # interpreter exit, those threads can abort the process (CPython 3.11 + gloo).
        gc.collect()


def _check_before_launch(strategy: Any, args: tuple[Any, ...]) -> None:
    import lightning.pytorch as pl

    model = args[0] if args else None  # fit/validate/test/predict pass the LightningModule first
    if isinstance(strategy, TunedDDPStrategy) and isinstance(model, pl.LightningModule):
        strategy._check_model(model)


class _CheckedSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ``python train.py``: the strategy checks the model before the other ranks start."""

    def __init__(self, strategy: "TunedDDPStrategy", *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # this process starts the others
            _check_before_launch(self._strategy, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _TunedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, checking the model before it starts the ranks and returning
    the tuned bucket size to the launching process: there, too, ``strategy.bucket_cap_mb`` is the
    size in force after ``fit``."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any) -> Any:
        _check_before_launch(self._strategy, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        strategy = trainer.strategy
        if isinstance(strategy, TunedDDPStrategy) and strategy._tuner is not None:
            extra[CHECKPOINT_KEY] = {"bucket_cap_mb": strategy._bucket_cap_mb, "tuning": strategy._tuner.record()}
        return extra

    @override
    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        state = extra.get(CHECKPOINT_KEY)
        strategy = trainer.strategy
        if isinstance(state, dict) and isinstance(strategy, TunedDDPStrategy) and strategy._tuner is not None:
            strategy._bucket_cap_mb = state["bucket_cap_mb"]
            strategy._tuner.adopt(state["tuning"])


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


def _reducer_named_params(model: DistributedDataParallel) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) in the order DDP's reducer indexes them."""
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []
    for module_name, module in model.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                named.append((full, param))
    return named


def _reducer_param_names(model: DistributedDataParallel) -> list[str]:
    """Names of the parameters in the order DDP's reducer indexes them."""
    return [name for name, _ in _reducer_named_params(model)]


_MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_is_full_backward_hook",
)


def _carry_module_hooks(old: Module, new: Module) -> None:
    """Give ``new`` the hooks registered on the ``old`` wrapper module itself.

    The very same dictionaries, so that a handle taken on the old wrapper still removes its
    hook. DDP registers none on itself; if it ever does, both sets are kept.
    """
    for name in _MODULE_HOOK_DICTS:
        hooks = getattr(old, name, None)
        if hooks is None:
            continue
        own = getattr(new, name)
        if isinstance(own, dict) and own:
            hooks.update(own)
        setattr(new, name, hooks)


@contextmanager
def _temporarily(obj: object, attr: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, saved)
