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

This class composes the pieces, each in its own module: argument checks and bucket caps
(``ddp_options``), the bucket layout (``ddp_layout``), launchers (``launchers``), the
rendezvous (``process_group``), the communication-hook chain (``comm.hook_chain``),
re-wrapping (``rewrap``), checkpoint state (``checkpoint_state``) and failure notes
(``_failures``).
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_mgpu._compat.lightning import DDPStrategyBase, PathLike, StrategyRegistryType
from lightning_mgpu.comm import powersgd_memory
from lightning_mgpu.comm.compression import ScaledFp16Allreduce, resolve_compression
from lightning_mgpu.strategies.checkpoint_io import (
    AtomicCheckpointIO,
    atomic_rename_target,
    load_naming_damage,
    names_damaged_files,
    replace_atomically,
)
from lightning_mgpu.strategies.preemption import Preemption
from lightning_mgpu.strategies.checkpoint_state import (
    CHECKPOINT_KEY,
    check_package,
    gather_powersgd_state,
    restore_powersgd_state,
    restore_tuned_size,
)
from lightning_mgpu.strategies.ddp_layout import BucketInfo, read_bucket_layout
from lightning_mgpu.strategies.hooked_ddp import HookedDDPStrategy
from lightning_mgpu.strategies.ddp_options import (
    DDP_DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_CAP_MB,
    DEFAULT_POWERSGD_RANK,
    DEFAULT_POWERSGD_START_ITER,
    MIB,
    bucket_kwargs,
    TUNED_STRATEGY_NAMES,
    check_options,
    first_cap_for,
)
from lightning_mgpu.strategies.auto_buckets import AutoBucketDriver
from lightning_mgpu.tuning.tuner import BucketTuner

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "CHECKPOINT_KEY",
    "DDP_DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_FIRST_BUCKET_CAP_MB",
    "BucketInfo",
    "TunedDDPStrategy",
]


class TunedDDPStrategy(HookedDDPStrategy):
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
        **kwargs: Any,
    ) -> None:
        self._default_checkpoint_io = checkpoint_io is None  # then an AtomicCheckpointIO, made when first asked for
        options = check_options(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            compression=compression,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            tune_steps=tune_steps,
            tune_candidates=tune_candidates,
            tune_rounds=tune_rounds,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            ddp_kwargs=kwargs,
        )
        kwargs = options.ddp_kwargs  # reserved arguments at their defaults dropped
        self._auto = options.tuning is not None
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
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._wire_dtype: Optional[torch.dtype] = None
        self._preemption = Preemption()
        self._pending_powersgd: Optional[dict[str, Any]] = None
        self.rewraps: list[dict[str, Any]] = []
        self._final_bucket_layout: Optional[list[BucketInfo]] = None  # kept at teardown (bucket_layout after fit)
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
        return first_cap_for(bucket_cap_mb, given_cap=self._bucket_cap_mb, given_first=self._first_bucket_cap_mb)

    @property
    def auto(self) -> bool:
        """True for ``bucket_cap_mb="auto"``."""
        return self._auto

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
    @override
    def tuning_active(self) -> bool:
        """True while ``bucket_cap_mb="auto"`` measures candidates."""
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
    @override
    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments given to ``DistributedDataParallel``, bucket sizes included."""
        return {**self.user_ddp_kwargs, **self._bucket_kwargs()}

    @property
    def bucket_layout(self) -> Optional[list[BucketInfo]]:
        """Gradient buckets as DDP built them, in launch order; None until DDP recorded them
        (from the third training step on). After fit: the last layout read before teardown."""
        layout = read_bucket_layout(self.model)
        return layout if layout is not None else self._final_bucket_layout

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The ``CheckpointIO`` you gave, as given; when none was, an
        :class:`~lightning_mgpu.strategies.checkpoint_io.AtomicCheckpointIO` (writes local files atomically,
        names a damaged file on load). A ``TorchCheckpointIO`` of yours writes atomically too: see
        :meth:`save_checkpoint`."""
        io = super().checkpoint_io  # Lightning's: a TorchCheckpointIO when none was given
        if self._default_checkpoint_io and not isinstance(io, AtomicCheckpointIO):
            io = AtomicCheckpointIO()
            DDPStrategyBase.checkpoint_io.fset(self, io)  # type: ignore[attr-defined]
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._default_checkpoint_io = io is None  # Trainer(plugins=[io]) sets the user's here: kept
        DDPStrategyBase.checkpoint_io.fset(self, io)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ setup lifecycle

    def _bucket_kwargs(self) -> dict[str, Any]:
        return bucket_kwargs(cap=self._bucket_cap_mb, given_first=self._first_bucket_cap_mb)

    def launcher_results(self) -> Optional[dict[str, Any]]:
        """After a spawn: the tuned size, for the launching process."""
        if self._tuner is None:
            return None
        return {"bucket_cap_mb": self._bucket_cap_mb, "tuning": self._tuner.record()}

    def adopt_launcher_results(self, results: dict[str, Any]) -> None:
        if self._tuner is not None:
            self._bucket_cap_mb = results["bucket_cap_mb"]
            self._tuner.adopt(results["tuning"])

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:  # SIGTERM stops every rank at a step boundary (preemption.py)
            self._preemption.attach(trainer, self)

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
        self.model = self.wrap_model(self.model)
        self.register_comm_hooks()

    # ------------------------------------------------------------------ bucket-size tuning (strategies/auto_buckets.py)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._preemption.on_train_start()
        self.rewraps = []
        if self._sizer is not None:
            self._sizer.on_train_start(self)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._sizer is not None:
            self._sizer.on_train_batch_start()

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if isinstance(self.comm_hook, ScaledFp16Allreduce):
            note = self.comm_hook.end_step()  # inf/NaN gradients or underflow: said, never silent
            if note is not None:
                rank_zero_warn(note)
        if self._sizer is not None:
            self._sizer.after_optimizer_step(self)
        return output

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
        keeper = self._hooks.powersgd_keeper
        if keeper is not None:
            package["powersgd"] = gather_powersgd_state(keeper, self.world_size)  # a collective: every rank is here
        # A TorchCheckpointIO of the user's (kept as given) writes to a temporary file beside the
        # checkpoint, renamed over its name once complete: atomic as our default writer is (checkpoint_io.py).
        local = atomic_rename_target(self.checkpoint_io, filepath, storage_options) if self.is_global_zero else None
        save = super().save_checkpoint
        if local is None:
            save(checkpoint, filepath, storage_options=storage_options)
        else:
            replace_atomically(local, lambda temporary: save(checkpoint, temporary, storage_options=None))

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Never unpickle arbitrary objects unless asked to (fit(..., weights_only=False)): torch before
        # 2.6, or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, would otherwise run code stored in the file.
        load, weights_only = super().load_checkpoint, True if weights_only is None else weights_only
        if names_damaged_files(self.checkpoint_io):  # a TorchCheckpointIO of the user's: damage named as ours does
            checkpoint = load_naming_damage(
                lambda: load(checkpoint_path, weights_only=weights_only), checkpoint_path, verify_checksums=True
            )
        else:
            checkpoint = load(checkpoint_path, weights_only=weights_only)
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

    @property
    @override
    def compression_hook_pending(self) -> bool:
        return self._compression is not None

    @override
    def on_new_powersgd_keeper(self, keeper: powersgd_memory.PowerSGDLayoutKeeper) -> None:
        self._restore_powersgd()

    def _restore_powersgd(self) -> None:
        saved, keeper = self._pending_powersgd, self._hooks.powersgd_keeper
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
        # Lightning's DDP names with "ddp" -> "ddp_tuned" (strategies/ddp_options.py: TUNED_STRATEGY_NAMES),
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
        self._hooks.clear()
        # The DDP wrapper holds the process group and its gloo threads; freed only at
        # interpreter exit, those threads can abort the process (CPython 3.11 + gloo).
        gc.collect()
        # Last: a preemption signal no step boundary acted on goes to the handler from before the fit.
        self._preemption.detach()
