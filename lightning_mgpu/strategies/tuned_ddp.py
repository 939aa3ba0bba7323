"""``TunedDDPStrategy``: Lightning's DDP with explicit gradient buckets and compression hooks.

Things stock ``DDPStrategy`` does not do:

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
* **``static_graph=True`` with gradient accumulation**, which stock Lightning crashes on.
* **Processes that start, meet, stop and fail safely**: the model checked before any rank
  starts, a loopback-only rendezvous on one machine, preemption, atomic checkpoints and errors
  that name the lost ranks.
* **Hangs reported in seconds, not after 30 minutes** (``hang_timeout``): which rank waits in
  which collective, which is elsewhere and at which line of your code, the likely cause and its
  fix; then every rank exits non-zero.

The class is the one place the Lightning hooks of our DDP strategies are overridden (``hybrid``
subclasses it); each hook hands its work to a part with one job (``strategies/parts/``): argument
checks (``options``), launchers (``launchers``), the rendezvous (``process_group``), the DDP wrapper
and its hook chain (``ddp_model``), the bucket-size search (``auto_buckets``), checkpoint state
(``checkpoint_state``), and preemption, checkpoint writing and failure notes (``reliability``).
Bucket sizes are :mod:`lightning_mgpu.tuning.buckets` arithmetic.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mgpu._compat.lightning import DDPStrategyBase, PathLike, StrategyRegistryType, in_accumulation_window
from lightning_mgpu.comm import powersgd_memory
from lightning_mgpu.comm.compression import ScaledFp16Allreduce, resolve_compression
from lightning_mgpu.comm.hook_chain import CommHookWrapper
from lightning_mgpu.strategies.parts.auto_buckets import AutoBucketDriver
from lightning_mgpu.strategies.parts.checkpoint_state import (
    CHECKPOINT_KEY,
    check_package,
    gather_powersgd_state,
    restore_powersgd_state,
    restore_tuned_size,
)
from lightning_mgpu.strategies.parts.ddp_model import BucketInfo, DDPModel, read_bucket_layout, reducer_named_params
from lightning_mgpu.strategies.parts.failures import reentrant_backward_explained
from lightning_mgpu.strategies.parts.launchers import checked_launcher
from lightning_mgpu.strategies.parts.options import (
    DEFAULT_POWERSGD_RANK,
    DEFAULT_POWERSGD_START_ITER,
    SUPPORTS_BUCKET_LIST,
    SUPPORTS_INIT_SYNC,
    TUNED_STRATEGY_NAMES,
    bucket_kwargs,
    check_backend_registered,
    check_options,
)
from lightning_mgpu.strategies.parts.process_group import destroy_process_group_at_exit, rendezvous
from lightning_mgpu.strategies.parts.reliability import Reliability
from lightning_mgpu.tuning.buckets import DDP_DEFAULT_BUCKET_CAP_MB, MIB, first_cap
from lightning_mgpu.tuning.tuner import BucketTuner
from lightning_mgpu.watch import DEFAULT_HANG_TIMEOUT_S, check_hang_timeout

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CHECKPOINT_KEY", "BucketInfo", "TunedDDPStrategy"]


class TunedDDPStrategy(DDPStrategyBase):
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
            more bytes). Only with ``compression="powersgd"`` (refused otherwise).
        powersgd_start_iter: Number of optimizer steps of plain all-reduce before PowerSGD
            takes over (at least 2: DDP rebuilds its buckets on the first step). Only with
            ``compression="powersgd"`` (refused otherwise).
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
        hang_timeout: Seconds without progress on a rank (and nobody working in its part of the run)
            before the hang watch reports where every rank is, which collective each waits in and at
            which line of your code, with the likely cause, and ends the job: every rank exits with
            status 124 (see :mod:`lightning_mgpu.watch`). Default 300; ``None`` turns the watch off.
            Progress is judged on the main thread (phases, batches, collectives left, its stack, CPU
            time and I/O): a slow step, a checkpoint save or rank-0-only work that makes progress
            never trips it; waiting in a collective does.

    Raises:
        ValueError: for any argument out of range or of the wrong type, naming it.

    Example::

        trainer = Trainer(strategy="ddp_tuned", devices=4)
        trainer = Trainer(strategy=TunedDDPStrategy(bucket_cap_mb=50, compression="fp16"), devices=4)
        trainer = Trainer(strategy=TunedDDPStrategy(bucket_cap_mb="auto"), devices=4)
    """

    strategy_name = "ddp_tuned"
    accepts_static_graph = True
    """Whether ``static_graph=True`` is a fix this strategy can offer (the hybrid strategy refuses it)."""

    def __init__(
        self,
        bucket_cap_mb: Union[None, float, Literal["auto"]] = None,
        first_bucket_cap_mb: Optional[float] = None,
        compression: Optional[Literal["fp16", "bf16", "powersgd"]] = None,
        powersgd_rank: int = DEFAULT_POWERSGD_RANK,
        powersgd_start_iter: int = DEFAULT_POWERSGD_START_ITER,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable[..., Any]] = None,
        ddp_comm_wrapper: Optional[Callable[..., Any]] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        tune_steps: Optional[int] = None,
        tune_candidates: Optional[Sequence[float]] = None,
        tune_rounds: int = 2,
        hang_timeout: Optional[float] = DEFAULT_HANG_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        self._hang_timeout = check_hang_timeout(hang_timeout, owner=type(self).__name__)
        self._given_checkpoint_io = checkpoint_io is not None  # else an AtomicCheckpointIO, made when first asked for
        # DDPStrategy's own arguments, checked here and passed on as given.
        stock: dict[str, Any] = dict(
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        options = check_options(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            compression=compression,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            tune_steps=tune_steps,
            tune_candidates=tune_candidates,
            tune_rounds=tune_rounds,
            ddp_kwargs=kwargs,
            **stock,
        )
        # Keep passing `**kwargs` on by that name: LightningCLI (jsonargparse) follows it through the source to
        # DDPStrategy and DistributedDataParallel to know which keyword arguments the class accepts.
        kwargs = options.ddp_kwargs  # reserved arguments at their defaults dropped
        self._bucket_cap_mb = options.bucket_cap_mb
        self._first_bucket_cap_mb = options.first_bucket_cap_mb
        self._compression = options.compression
        self._powersgd_rank = options.powersgd_rank
        self._powersgd_start_iter = options.powersgd_start_iter
        self._tuner: Optional[BucketTuner] = None
        self._sizer: Optional[AutoBucketDriver] = None
        if options.tuning is not None:
            self._tuner = BucketTuner(
                options.tuning, default_mb=DDP_DEFAULT_BUCKET_CAP_MB, first_cap_for=self._first_cap_for
            )
            self._sizer = AutoBucketDriver(self._tuner, owner=type(self).__name__, rewrap=self._rewrap)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            ddp_comm_state=ddp_comm_state,
            **stock,
            **kwargs,
        )
        self._ddp = DDPModel()
        self._reliability = Reliability(hang_timeout=self._hang_timeout)
        self._wire_dtype: Optional[torch.dtype] = None
        self._pending_powersgd: Optional[dict[str, Any]] = None
        self._at_step_start = True  # the next batch is the first of an optimizer step
        self.rewraps: list[dict[str, Any]] = []
        """Every re-wrap of this fit (``bucket_cap_mb="auto"``): global step, batch, new size."""
        self._final_bucket_layout: Optional[list[BucketInfo]] = None  # kept at teardown (bucket_layout after fit)

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
        return first_cap(
            bucket_cap_mb,
            given_cap=self._bucket_cap_mb,
            given_first=self._first_bucket_cap_mb,
            per_bucket_caps=SUPPORTS_BUCKET_LIST,
        )

    @property
    def hang_timeout(self) -> Optional[float]:
        """Seconds without progress before the hang watch ends the job (None: no watch)."""
        return self._hang_timeout

    @property
    def auto(self) -> bool:
        """True for ``bucket_cap_mb="auto"``."""
        return self._tuner is not None

    @property
    def tuner(self) -> Optional[BucketTuner]:
        """With ``"auto"``: the search's state machine (``lightning-mgpu tune`` adjusts its settings)."""
        return self._tuner

    @property
    def tuning_status(self) -> Optional[str]:
        """With ``"auto"``: ``"waiting"``, ``"observing"``, ``"measuring"``, then ``"done"``,
        ``"skipped"`` (DDP's default kept), ``"resumed"`` (size from a checkpoint) or
        ``"unfinished"`` (the fit ended first); None otherwise. Cheap: read it every step."""
        return None if self._tuner is None else self._tuner.status

    @property
    def tuning_active(self) -> bool:
        """True while ``bucket_cap_mb="auto"`` measures candidates (the hook must not change then)."""
        return self._tuner is not None and self._tuner.active

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
    def wire_ratio(self) -> Optional[float]:
        """Bytes on the wire per byte of gradient: 0.5 for fp16/bf16, None for PowerSGD (not a fixed
        ratio), else 1.0 (a plain all-reduce; assumed for a user's own ``ddp_comm_hook`` too)."""
        if self._compression in ("fp16", "bf16"):
            return 0.5
        return None if self._compression == "powersgd" else 1.0

    @property
    def compression_stats(self) -> Optional[dict[str, Any]]:
        """With ``compression="fp16"``: steps with inf/NaN gradients, the last step's largest gradient
        magnitude and the elements lost to underflow (:class:`~lightning_mgpu.comm.compression.ScaledFp16Allreduce`);
        None otherwise."""
        hook = self.comm_hook
        return hook.stats if isinstance(hook, ScaledFp16Allreduce) else None

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments given to ``DistributedDataParallel``, bucket sizes included."""
        return self.ddp_kwargs_for(self._bucket_cap_mb)

    def ddp_kwargs_for(self, bucket_cap_mb: Optional[float]) -> dict[str, Any]:
        """The ``DistributedDataParallel`` keyword arguments with buckets of ``bucket_cap_mb`` (None: DDP's default)."""
        return {**self.user_ddp_kwargs, **bucket_kwargs(cap=bucket_cap_mb, given_first=self._first_bucket_cap_mb)}

    @property
    def bucket_layout(self) -> Optional[list[BucketInfo]]:
        """Gradient buckets as DDP built them, in launch order; None until DDP recorded them
        (from the third training step on). After fit: the last layout read before teardown."""
        layout = read_bucket_layout(self.model)
        return layout if layout is not None else self._final_bucket_layout

    @property
    def powersgd_keeper(self) -> Optional[powersgd_memory.PowerSGDLayoutKeeper]:
        """With ``compression="powersgd"``: the keeper of PowerSGD's memory (None before DDP is set up)."""
        return self._ddp.hooks.powersgd_keeper

    @property
    def prescaler(self) -> Any:
        """The prescaled all-reduce in use (a wrapper asked for a Python hook and nothing else did), or None."""
        return self._ddp.hooks.prescaler

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The ``CheckpointIO`` you gave, as given; when none was, an
        :class:`~lightning_mgpu.strategies.parts.checkpoint_io.AtomicCheckpointIO` (writes local files
        atomically, names a damaged file on load). A ``TorchCheckpointIO`` of yours writes atomically too:
        see :meth:`save_checkpoint`."""
        io = super().checkpoint_io  # Lightning's: a TorchCheckpointIO when none was given
        chosen = self._reliability.checkpoint_io(io, given=self._given_checkpoint_io)
        if chosen is not io:
            DDPStrategyBase.checkpoint_io.fset(self, chosen)  # type: ignore[attr-defined]
        return chosen

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._given_checkpoint_io = io is not None  # Trainer(plugins=[io]) sets the user's here: kept
        DDPStrategyBase.checkpoint_io.fset(self, io)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ launching and meeting

    @override
    def configure_launcher(self) -> None:
        super().configure_launcher()
        self.set_launcher(checked_launcher(self, self.launcher))

    def check_model(self, model: "pl.LightningModule") -> None:
        """Checks of the arguments that need the LightningModule. Lightning's own launchers run them in
        the launching process before they start the other ranks, so that a mistake is one clear error
        rather than one traceback per rank (each rank checks again at setup). Subclasses extend it."""

    def launcher_results(self) -> Optional[dict[str, Any]]:
        """After a spawn: the tuned size, for the launching process."""
        if self._tuner is None:
            return None
        return {"bucket_cap_mb": self._bucket_cap_mb, "tuning": self._tuner.record()}

    def adopt_launcher_results(self, results: dict[str, Any]) -> None:
        if self._tuner is not None:
            self._bucket_cap_mb = results["bucket_cap_mb"]
            self._tuner.adopt(results["tuning"])

    def process_group_device(self) -> Optional[torch.device]:
        """The device NCCL binds its communicator to (``init_process_group(device_id=...)``); None on CPU.
        A strategy whose process spans several GPUs returns None: a bound NCCL group refuses
        collectives on any other device."""
        return self.root_device if self.root_device.type != "cpu" else None

    @override
    def setup_distributed(self) -> None:
        # DDPStrategy.setup_distributed, with a rendezvous that listens on the loopback interface
        # only when every rank runs on this machine, and survives torchrun's restarts (parts/process_group.py).
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        check_backend_registered(self.resolved_backend())  # names registered after construction count
        kwargs: dict[str, Any] = {"device_id": self.process_group_device()}
        with rendezvous(
            self.cluster_environment,
            self.global_rank,
            self.world_size,
            self.collective_timeout,
            self.resolved_backend(),
        ) as store:
            if store is not None:  # torchrun restarts only: init_process_group is otherwise called as Lightning does
                kwargs["store"] = store
            self.init_process_group(**kwargs)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        self._reliability.setup(trainer, self)  # preemption: every rank stops at a step boundary (parts/reliability.py)

    # ------------------------------------------------------------------ the DDP wrapper

    def wrap_model(self, model: Module, *, bucket_cap_mb: Optional[float], **extra: Any) -> DistributedDataParallel:
        """``model`` in a new ``DistributedDataParallel`` with buckets of ``bucket_cap_mb`` (and ``extra`` options)."""
        return self._ddp.build(
            model,
            ddp_kwargs={**self.ddp_kwargs_for(bucket_cap_mb), **extra},
            device_ids=self.determine_ddp_device_ids(),
        )

    @override
    def configure_ddp(self) -> None:
        spec = resolve_compression(
            self._compression,
            backend=self.resolved_backend(),
            powersgd_rank=self._powersgd_rank,
            powersgd_start_iter=self._powersgd_start_iter,
        )
        if spec is not None:
            self.set_comm_hook(spec.hook, spec.state)
            self._wire_dtype = spec.wire_dtype
        assert self.model is not None
        self._final_bucket_layout = None  # a new fit: the last one's layout no longer holds
        self.model = self.wrap_model(self.model, bucket_cap_mb=self._bucket_cap_mb)
        self.register_comm_hooks()

    def register_comm_hooks(self) -> None:
        """Register the hook chain on the DDP wrapper (Lightning does so on CUDA only; DDP supports every backend)."""
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        built = self._ddp.hooks.build(
            hook=self.comm_hook,
            state=self.comm_state,
            user_wrapper=self.comm_wrapper,
            world_size=self.world_size,
            backend=self.resolved_backend(),
            named_parameters=lambda: reducer_named_params(model),
            on_new_powersgd_keeper=lambda keeper: self._restore_powersgd(),
            python_hook_anyway=self.has_own_comm_hook,
        )
        if built is not None:  # else DDP's built-in all-reduce is the whole chain
            model.register_comm_hook(state=built[1], hook=built[0])

    def _rewrap(self, bucket_cap_mb: Optional[float]) -> None:
        """Replace the DDP wrapper by a new one with buckets of ``bucket_cap_mb``, hooks carried over; between
        optimizer steps only (``bucket_cap_mb="auto"``'s sizes, ``CommProfiler``'s windows)."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        if in_accumulation_window(trainer):  # callers re-wrap after an optimizer step; never risk it
            raise RuntimeError(
                f"{type(self).__name__}: refusing to re-wrap the model inside a gradient-accumulation window "
                f"(global step {trainer.global_step}); please report this."
            )
        old = self.model
        assert isinstance(old, DistributedDataParallel)
        if self._ddp.hooks.powersgd_keeper is None and powersgd_memory.reset_bucket_memory(self.comm_state):
            rank_zero_warn(
                "bucket_cap_mb='auto' re-wrapped the model: the PowerSGD memory of this hook is kept per bucket "
                "number and cannot be remapped (batch_tensors_with_same_shape=True or batched_powerSGD_hook), so "
                "its error feedback and warm start were reset."
            )
        # Parameters are already equal on every rank: no broadcast of the weights again.
        extra = {"init_sync": False} if SUPPORTS_INIT_SYNC else {}
        self.model = self._ddp.rebuild(old, lambda: self.wrap_model(module, bucket_cap_mb=bucket_cap_mb, **extra))
        self.register_comm_hooks()
        if bucket_cap_mb != self._bucket_cap_mb:
            self._bucket_cap_mb = bucket_cap_mb
            self.rewraps.append(
                {
                    "global_step": trainer.global_step,
                    "batches_in_epoch": trainer.fit_loop.epoch_loop.batch_progress.current.ready,
                    "bucket_cap_mb": bucket_cap_mb,
                }
            )

    # ------------------------------------------------------------------ the communication hook (CommHookHost)

    @property
    def compression_hook_pending(self) -> bool:
        """True when a compression hook will be set when DDP is configured (a Python hook in any case)."""
        return self._compression is not None

    def add_comm_hook_wrapper(self, wrapper: CommHookWrapper, *, pausable: bool = False) -> None:
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
        self._ddp.hooks.add(wrapper, pausable=pausable)

    @property
    def has_own_comm_hook(self) -> bool:
        """True when DDP runs a Python communication hook whatever the pausable wrappers
        (compression, ``ddp_comm_hook``, ``ddp_comm_wrapper``, a wrapper that is not pausable);
        False when without them it would use its built-in C++ all-reduce."""
        if self.compression_hook_pending:  # its hook is set when DDP is configured
            return True
        return self._ddp.hooks.needs_python_hook(base_hook=self.comm_hook, user_wrapper=self.comm_wrapper)

    @property
    def comm_hook_wrappers_on(self) -> bool:
        """Whether the pausable wrappers (:meth:`add_comm_hook_wrapper`) are switched on."""
        return self._ddp.hooks.wrappers_on

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
        hooks = self._ddp.hooks
        if on == hooks.wrappers_on:
            return True
        if self.tuning_active:
            return False
        rewrap = hooks.has_pausable and not self.has_own_comm_hook and isinstance(self.model, DistributedDataParallel)
        if rewrap and not SUPPORTS_INIT_SYNC:
            return False
        hooks.wrappers_on = on
        if rewrap:
            self._rewrap(self._bucket_cap_mb)
        return True

    # ------------------------------------------------------------------ a step

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._reliability.on_train_start()
        self._at_step_start = True
        self.rewraps = []
        if self._sizer is not None:
            self._sizer.on_train_start(self)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._at_step_start:  # the first batch of an optimizer step (of an accumulation window)
            self._at_step_start = False
            if self._sizer is not None:
                self._sizer.at_step_start()

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        self._ddp.prescale(closure_loss)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.backward_errors_explained():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._ddp.after_backward(self.model)

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """``no_sync`` for the backwards of a gradient-accumulation window, except a static graph's first,
        which DDP refuses under ``no_sync`` (see :mod:`~lightning_mgpu.strategies.parts.ddp_model`)."""
        with self._ddp.no_sync(self.model):
            yield None

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._at_step_start = True
        if isinstance(self.comm_hook, ScaledFp16Allreduce):
            note = self.comm_hook.end_step()  # inf/NaN gradients or underflow: said, never silent
            if note is not None:
                rank_zero_warn(note)
        if self._sizer is not None:
            self._sizer.after_optimizer_step(self)
        return output

    # ------------------------------------------------------------------ failures

    def backward_errors_explained(self) -> Any:
        """Around the backward: DDP's "Expected to mark a variable ready only once" (reentrant activation
        checkpointing) re-raised as a :class:`~lightning_mgpu.strategies.parts.failures.ReentrantCheckpointError`
        naming the fixes, torch's error as its cause."""
        return reentrant_backward_explained(**self._ddp_facts())

    def _ddp_facts(self) -> dict[str, Any]:
        ddp_kwargs = self.user_ddp_kwargs
        return {
            "strategy": type(self).__name__,
            "find_unused_parameters": bool(ddp_kwargs.get("find_unused_parameters")),
            "static_graph": bool(ddp_kwargs.get("static_graph")),
            "static_graph_supported": self.accepts_static_graph,
        }

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._reliability.on_exception(
            exception,
            launcher=self.launcher,
            rank=self.global_rank,
            timeout=self.collective_timeout,
            **self._ddp_facts(),
        )

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
        self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        package = checkpoint.setdefault(CHECKPOINT_KEY, {})
        package.update(self.state_for_checkpoint())
        keeper = self._ddp.hooks.powersgd_keeper
        if keeper is not None:
            package["powersgd"] = gather_powersgd_state(keeper, self.world_size)  # a collective: every rank is here
        save = super().save_checkpoint
        self._reliability.save_checkpoint(
            self.checkpoint_io,
            lambda path, options: save(checkpoint, path, storage_options=options),
            filepath,
            storage_options,
            writes=self.is_global_zero,
        )

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Never unpickle arbitrary objects unless asked to (fit(..., weights_only=False)): torch before
        # 2.6, or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, would otherwise run code stored in the file.
        load, weights_only = super().load_checkpoint, True if weights_only is None else weights_only
        checkpoint = self._reliability.load_checkpoint(
            self.checkpoint_io, lambda: load(checkpoint_path, weights_only=weights_only), checkpoint_path
        )
        if CHECKPOINT_KEY in checkpoint:
            try:
                package = check_package(checkpoint[CHECKPOINT_KEY])
            except ValueError as error:
                raise ValueError(
                    f"checkpoint {checkpoint_path}: {error}. A checkpoint written by lightning_mgpu never holds this: "
                    "the file was damaged or edited. Restore or delete that entry, or resume from another checkpoint."
                ) from None
            self._restore_package_state(package)
        return checkpoint

    def _restore_package_state(self, package: dict[str, Any]) -> None:
        """Before ``setup``: a tuned bucket size (reused, no tuning) and PowerSGD's memory."""
        size = restore_tuned_size(self._tuner, package)
        if size is not None:
            self._bucket_cap_mb = size
        saved = package.get("powersgd")
        if isinstance(saved, dict):
            self._pending_powersgd = saved

    def _restore_powersgd(self) -> None:
        saved, keeper = self._pending_powersgd, self._ddp.hooks.powersgd_keeper
        if saved is None or keeper is None:
            return
        self._pending_powersgd = None
        restore_powersgd_state(
            keeper, saved, world_size=self.world_size, global_rank=self.global_rank, owner=type(self).__name__
        )

    # ------------------------------------------------------------------ registration

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        # Lightning's DDP names with "ddp" -> "ddp_tuned" (parts/options.py: TUNED_STRATEGY_NAMES),
        # then our own presets.
        for name, description, init_params in TUNED_STRATEGY_NAMES:
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        if self._sizer is not None:
            self._sizer.teardown()
        layout = self.bucket_layout
        self._final_bucket_layout = layout
        if layout:
            sizes = ", ".join(f"{b.bytes / MIB:.2f}" for b in layout)
            buckets = "1 gradient bucket" if len(layout) == 1 else f"{len(layout)} gradient buckets"
            rank_zero_info(
                f"{type(self).__name__}: {buckets} of [{sizes}] MiB "
                f"(caps: first {self.first_bucket_cap_mb:g} MiB, then {self.bucket_cap_mb:g} MiB)."
            )
        super().teardown()
        # Wrappers belong to one fit (callbacks add them again in their setup). The PowerSGD keeper
        # stays: a checkpoint saved after fit still carries its memory.
        self._ddp.hooks.clear()
        # The DDP wrapper holds the process group and its gloo threads; freed only at
        # interpreter exit, those threads can abort the process (CPython 3.11 + gloo).
        gc.collect()
        # Last: a preemption signal no step boundary acted on goes to the handler from before the fit.
        self._reliability.teardown()
