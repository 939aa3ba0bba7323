"""Private Lightning names, each behind a function of ours with a version guard (see ``_compat``).

Append new shims at the end as self-contained blocks: a ``guarded(...)`` declaration,
then the public function that uses it (with its fallback or a clear error).
"""

from __future__ import annotations

from lightning_mgpu._compat import guarded, shadow  # noqa: F401


# ---------------------------------------------------------------------------------------
# DDPStrategy's private extension points, launchers and types (used by strategies/)
# ---------------------------------------------------------------------------------------
from datetime import timedelta as _timedelta
from typing import Any as _Any, Callable as _Callable, Optional as _Optional

import lightning.pytorch as _pl
from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy

_CONFIGURE_LAUNCHER = guarded(
    "lightning.pytorch.strategies",
    "DDPStrategy._configure_launcher",
    required=True,
    why="the Trainer asks the strategy for its launcher here; our strategies pick their own",
)
_DDP_PRIVATE_STATE = guarded(
    "lightning.pytorch.strategies",
    "DDPStrategy._get_process_group_backend",
    required=True,
    why="DDPStrategy keeps its options in private attributes (_ddp_kwargs, _ddp_comm_hook, _ddp_comm_state, "
    "_ddp_comm_wrapper, _timeout, _start_method, _process_group_backend, _launcher); DDPStrategyBase exposes them",
)
_MP_LAUNCHER = guarded(
    "lightning.pytorch.strategies.launchers.multiprocessing",
    "_MultiProcessingLauncher",
    required=True,
    why="Lightning's spawn/fork launcher, subclassed to check the model first and bring the tuned size home",
)
_SCRIPT_LAUNCHER = guarded(
    "lightning.pytorch.strategies.launchers.subprocess_script",
    "_SubprocessScriptLauncher",
    required=True,
    why="Lightning's `python train.py` launcher, subclassed to check the model before starting ranks",
)
_INIT_DIST = guarded(
    "lightning.fabric.utilities.distributed",
    "_init_dist_connection",
    required=True,
    why="Lightning's process-group set-up (environment variables, rank-zero logging) that DDPStrategy calls",
)
_STRATEGY_REGISTRY = guarded(
    "lightning.fabric.strategies",
    "_StrategyRegistry",
    required=False,
    why="the type of the strategy registry passed to register_strategies (annotation only)",
)
_PATH_TYPE = guarded(
    "lightning.fabric.utilities.types", "_PATH", required=False, why="Lightning's path type (annotation only)"
)
_SHOULD_ACCUMULATE = guarded(
    "lightning.pytorch.loops.training_epoch_loop",
    "_TrainingEpochLoop._should_accumulate",
    required=False,
    why="whether the current batch is inside a gradient-accumulation window (re-wraps refuse to run there)",
)

from lightning.fabric.strategies import _StrategyRegistry  # noqa: E402
from lightning.fabric.utilities.distributed import _init_dist_connection  # noqa: E402
from lightning.fabric.utilities.types import _PATH  # noqa: E402
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: E402
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher  # noqa: E402

StrategyRegistryType = _StrategyRegistry
PathLike = _PATH
MultiProcessingLauncher = _MultiProcessingLauncher
SubprocessScriptLauncher = _SubprocessScriptLauncher


class DDPStrategyBase(_DDPStrategy):
    """Lightning's ``DDPStrategy`` with its private extension points and state made public.

    Our strategies subclass this, never ``DDPStrategy`` directly, and override only public
    names: :meth:`configure_launcher` (for ``_configure_launcher``), and read the parent's
    options through the properties below.
    """

    def _configure_launcher(self) -> None:
        self.configure_launcher()

    def configure_launcher(self) -> None:
        """Pick this strategy's launcher (default: Lightning's); then :attr:`launcher` is it."""
        _DDPStrategy._configure_launcher(self)

    def set_launcher(self, launcher: _Any) -> None:
        self._launcher = launcher

    def launcher_strategy(self, launcher: _Any) -> _Any:
        """The strategy a Lightning spawn launcher was made for."""
        return launcher._strategy

    @property
    def start_method(self) -> str:
        return str(self._start_method)

    @property
    def collective_timeout(self) -> _Optional[_timedelta]:
        """``timeout=``: how long a collective may wait for the other ranks."""
        return self._timeout

    @property
    def user_ddp_kwargs(self) -> dict[str, _Any]:
        """Keyword arguments given for ``DistributedDataParallel`` (bucket sizes not included)."""
        return dict(self._ddp_kwargs)

    @property
    def comm_hook(self) -> _Optional[_Callable[..., _Any]]:
        return self._ddp_comm_hook

    @property
    def comm_state(self) -> _Any:
        return self._ddp_comm_state

    @property
    def comm_wrapper(self) -> _Optional[_Callable[..., _Any]]:
        return self._ddp_comm_wrapper

    def set_comm_hook(self, hook: _Optional[_Callable[..., _Any]], state: _Any) -> None:
        self._ddp_comm_hook, self._ddp_comm_state = hook, state

    def resolved_backend(self) -> str:
        """The backend name in force: the one given, or nccl on GPUs and gloo on CPU."""
        return str(self._get_process_group_backend())

    def init_process_group(self, **kwargs: _Any) -> None:
        """What ``DDPStrategy.setup_distributed`` does after ``set_world_ranks``, with extra
        ``init_process_group`` keyword arguments (``device_id``, ``store``)."""
        self._process_group_backend = self.resolved_backend()
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout, **kwargs)


def in_accumulation_window(trainer: "_pl.Trainer") -> bool:
    """True when the batch being run is not the last of a gradient-accumulation window."""
    epoch_loop = trainer.fit_loop.epoch_loop
    should = getattr(epoch_loop, _SHOULD_ACCUMULATE.attribute.rsplit(".", 1)[-1], None)
    if should is None:  # fallback: Lightning's own rule from public counters
        done = (epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches) == 0
        return not done
    return bool(should())


# ---------------------------------------------------------------------------------------
# DistributedDoctor (callbacks/doctor/): train-loader fetch timing, epoch metrics logged
# without sync_dist, Trainer(use_distributed_sampler=...), the sampler inside Lightning's
# DistributedSamplerWrapper. Each function says when it cannot see: the doctor then reports
# the rule as not checked, never as passed.
# ---------------------------------------------------------------------------------------
import time as _doctor_time
from typing import Any as _DoctorAny, Callable as _DoctorCallable, Optional as _DoctorOptional

_TRAIN_FETCH_START = guarded(
    "lightning.pytorch.loops.training_epoch_loop",
    "_TrainingEpochLoop._on_before_fetch",
    required=False,
    why="the epoch loop calls it right before each train-loader next() (for Lightning's profiler); "
    "DistributedDoctor times the fetch through it (fallback: dataloader-starving not checked)",
)
_TRAIN_FETCH_END = guarded(
    "lightning.pytorch.loops.training_epoch_loop",
    "_TrainingEpochLoop._on_after_fetch",
    required=False,
    why="called right after each train-loader next(); the end of DistributedDoctor's fetch timing",
)


def time_train_fetches(
    trainer: _DoctorAny, on_fetch: "_DoctorCallable[[float], None]"
) -> "_DoctorOptional[_DoctorCallable[[], None]]":
    """Call ``on_fetch(seconds)`` after each train-loader ``next()`` of ``trainer``'s fit (from the next
    epoch run on); returns the function that undoes it, or None when this Lightning has no such hooks.

    Why not the public batch hooks: the time between ``on_train_batch_end`` and the next
    ``on_train_batch_start`` also holds validation, checkpoint saves, logging and the progress
    bar (whose ``.item()`` waits for the GPU): it would blame the loader for them.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    names = [entry.attribute.rsplit(".", 1)[-1] for entry in (_TRAIN_FETCH_START, _TRAIN_FETCH_END)]
    before, after = (getattr(epoch_loop, name, None) for name in names)
    if not callable(before) or not callable(after):
        return None
    started: list[float] = []

    def on_before_fetch() -> None:
        started[:] = [_doctor_time.perf_counter()]
        before()

    def on_after_fetch() -> None:
        after()
        if started:
            on_fetch(_doctor_time.perf_counter() - started.pop())

    # The epoch loop hands its (shadowed) hooks to its data fetcher at every epoch run.
    return shadow(epoch_loop, {names[0]: on_before_fetch, names[1]: on_after_fetch})


_RESULTS = guarded(
    "lightning.pytorch.trainer.trainer",
    "Trainer._results",
    required=False,
    why="the running values of self.log(...) metrics, with their options (DistributedDoctor's unsynced-logging "
    "compares them across ranks mid-epoch; fallback: not checked)",
)
_METRIC_SYNC = guarded(
    "lightning.pytorch.trainer.connectors.logger_connector.result",
    "_Metadata._sync",
    required=False,
    why="a logged metric's sync_dist/rank_zero_only options (no public accessor while the epoch runs)",
)


def epoch_metrics_logged_without_sync(trainer: _DoctorAny) -> "_DoctorOptional[dict[str, float]]":
    """This rank's current value of every tensor metric logged with ``on_epoch=True``, ``sync_dist=False``
    (and not ``rank_zero_only``): the mean so far for mean reductions, else the reduced value.
    ``{}`` outside a loop; None when this Lightning keeps them where we cannot see.
    """
    name = _RESULTS.attribute.rsplit(".", 1)[-1]
    sync_name = _METRIC_SYNC.attribute.rsplit(".", 1)[-1]
    if not hasattr(type(trainer), name):
        return None
    results = getattr(trainer, name)
    values: dict[str, float] = {}
    if results is None:
        return values
    for key, metric in list(results.items()):
        meta = getattr(metric, "meta", None)
        if meta is None or not getattr(metric, "is_tensor", False) or not meta.on_epoch:
            continue
        if not hasattr(meta, sync_name):
            return None
        sync = getattr(meta, sync_name)
        if sync is None or sync.should or sync.rank_zero_only:
            continue
        value = metric.value
        if meta.is_mean_reduction:
            count = float(metric.cumulated_batch_size)
            if count == 0:
                continue
            values[str(key)] = float(value) / count
        else:
            values[str(key)] = float(value)
    return values


_ACCELERATOR_CONNECTOR = guarded(
    "lightning.pytorch.trainer.connectors.accelerator_connector",
    "_AcceleratorConnector",
    required=False,
    why="Trainer(use_distributed_sampler=...) is kept only on trainer._accelerator_connector (an instance "
    "attribute: the class is declared); DistributedDoctor names it in data-not-sharded's message, and leaves "
    "it out when unknown",
)


def trainer_uses_distributed_sampler(trainer: _DoctorAny) -> "_DoctorOptional[bool]":
    """``Trainer(use_distributed_sampler=...)``; None when this Lightning keeps it elsewhere."""
    connector = getattr(trainer, "_accelerator_connector", None)
    value = getattr(connector, "use_distributed_sampler", None)
    return value if isinstance(value, bool) else None


_DATASET_SAMPLER_WRAPPER = guarded(
    "lightning.fabric.utilities.distributed",
    "_DatasetSamplerWrapper",
    required=False,
    why="DistributedSamplerWrapper keeps the user's sampler in its dataset's _sampler (an instance attribute: "
    "the class is declared); DistributedDoctor reads it to tell a fixed order from a shuffled one "
    "(fallback: sampler-epoch-not-set not judged for that loader)",
)


def sampler_wrapped_for_distribution(sampler: object) -> object:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper`` ``sampler``; None when ``sampler``
    is no such wrapper. Raises ``LookupError`` when it is one but this Lightning keeps it elsewhere."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    if not isinstance(sampler, DistributedSamplerWrapper):
        return None
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    if inner is None:
        raise LookupError(
            f"this Lightning's DistributedSamplerWrapper does not keep the wrapped sampler where "
            f"{_DATASET_SAMPLER_WRAPPER.module}.{_DATASET_SAMPLER_WRAPPER.attribute}._sampler was"
        )
    return inner


# ---------------------------------------------------------------------------------------
# Preemption (strategies/parts/preemption.py): Lightning 2.6's SIGTERM handler runs a collective
# broadcast inside the signal handler (a deadlock when only some ranks get the signal, or get it
# mid-collective), and its SLURM requeue handler saves a checkpoint there (a barrier, again inside
# the handler). Our strategies replace both, on the Trainer's own signal connector, by a function
# that only sets a flag; the ranks agree on it at the next step boundary.
# ---------------------------------------------------------------------------------------
from typing import Any as _PreemptAny, Callable as _PreemptCallable, Optional as _PreemptOptional

_SIGTERM_NOTIFIER = guarded(
    "lightning.pytorch.trainer.connectors.signal_connector",
    "_SignalConnector._sigterm_notifier_fn",
    required=False,
    why="the SIGTERM handler Trainer._signal_connector (an instance attribute: the class is declared) registers "
    "when fit starts; it broadcasts from inside the handler. Shadowed per trainer by a flag-only function "
    "(fallback: our own handlers from on_train_start on, Lightning's before that)",
)
_SLURM_REQUEUE_HANDLER = guarded(
    "lightning.pytorch.trainer.connectors.signal_connector",
    "_SignalConnector._slurm_sigusr_handler_fn",
    required=False,
    why="the SLURM requeue-signal handler (auto_requeue): saves a checkpoint and requeues from inside the handler; "
    "shadowed the same way",
)


def route_preemption_signals(
    trainer: _PreemptAny, notify: "_PreemptCallable[[int], None]"
) -> "_PreemptOptional[_PreemptCallable[[], None]]":
    """Make the handlers ``trainer``'s signal connector registers at the start of a fit call only
    ``notify(signum)`` (call this before they are registered, e.g. from ``strategy.setup``). Returns
    the function that undoes it; None when this Lightning keeps them elsewhere (nothing changed)."""
    connector = getattr(trainer, "_signal_connector", None)
    names = [entry.attribute.rsplit(".", 1)[-1] for entry in (_SIGTERM_NOTIFIER, _SLURM_REQUEUE_HANDLER)]
    if connector is None or not all(callable(getattr(connector, name, None)) for name in names):
        return None

    def flag_only(signum: _PreemptAny, frame: _PreemptAny) -> None:
        notify(int(signum))

    # register_signal_handlers reads the (shadowed) handlers when fit starts.
    return shadow(connector, dict.fromkeys(names, flag_only))


# ---------------------------------------------------------------------------------------
# CommProfiler under Lightning's own DDPStrategy (strategy="ddp"): the user's communication hook
# and wrapper that DDPStrategy keeps in private attributes, read and (for the wrapper) replaced,
# so that the profiler's timer joins what Lightning registers instead of being refused by DDP.
# ---------------------------------------------------------------------------------------
from typing import Any as _StockAny, Callable as _StockCallable, Optional as _StockOptional

_STOCK_REGISTER_HOOKS = guarded(
    "lightning.pytorch.strategies",
    "DDPStrategy._register_ddp_hooks",
    required=False,
    why="DDPStrategy registers self._ddp_comm_hook (wrapped by self._ddp_comm_wrapper) here, on CUDA only; "
    "CommProfiler reads the hook and composes its timer into the wrapper (fallback: a user's hook on CUDA "
    "is left alone and the buckets are not timed)",
)


def stock_ddp_comm_hook(strategy: _StockAny) -> "_StockOptional[_StockCallable[..., _StockAny]]":
    """The ``ddp_comm_hook`` given to a stock ``DDPStrategy`` (None: none, or not readable here)."""
    hook = getattr(strategy, "_ddp_comm_hook", None)
    return hook if callable(hook) else None


def stock_ddp_registers_comm_hook(strategy: _StockAny) -> bool:
    """Whether stock ``DDPStrategy`` will register the user's hook itself when it wraps the model
    (Lightning's rule: a hook was given and the device is CUDA)."""
    if not callable(getattr(strategy, _STOCK_REGISTER_HOOKS.attribute.rsplit(".", 1)[-1], None)):
        return False
    return stock_ddp_comm_hook(strategy) is not None and strategy.root_device.type == "cuda"


def replace_stock_ddp_comm_wrapper(
    strategy: _StockAny,
    make: "_StockCallable[[_StockOptional[_StockCallable[..., _StockAny]]], _StockCallable[..., _StockAny]]",
) -> "_StockOptional[_StockCallable[[], None]]":
    """Replace a stock ``DDPStrategy``'s ``ddp_comm_wrapper`` by ``make(the user's wrapper or None)``
    before it wraps the model; returns the function that puts the user's back (None: not possible)."""
    if not hasattr(strategy, "_ddp_comm_wrapper"):
        return None
    original = strategy._ddp_comm_wrapper
    strategy._ddp_comm_wrapper = make(original)

    def undo() -> None:
        strategy._ddp_comm_wrapper = original

    return undo


# ---------------------------------------------------------------------------------------
# Lightning's child-process observer (``python train.py``): a thread of the launching process that
# polls its child ranks every 5 s and SIGKILLs them and its own process (local rank 0) once one
# ended non-zero. The launching process may be busy in its step then, seconds before the collective
# that would fail and say which rank was lost: our launcher has the observer say it first.
# ---------------------------------------------------------------------------------------
import threading as _threading
from typing import Any as _ObserverAny, Callable as _ObserverCallable

_CHILD_OBSERVER = guarded(
    "lightning.fabric.strategies.launchers.subprocess_script",
    "_ChildProcessObserver._terminate_all",
    required=False,
    why="the observer thread's kill of every process of the job (its children in _child_processes); shadowed to "
    "name the ended ranks first (fallback: Lightning's own line, which names the pid)",
)


def before_children_are_killed(procs: "list[_ObserverAny]", say: "_ObserverCallable[[], None]") -> bool:
    """Have Lightning's observer of ``procs`` (the launcher's list of child processes, already started) call
    ``say()`` just before it kills them and this process. False when no such observer runs here."""
    observers = [
        thread
        for thread in _threading.enumerate()
        if type(thread).__name__ == "_ChildProcessObserver"
        and getattr(thread, "_child_processes", None) is procs
        and callable(getattr(thread, "_terminate_all", None))
    ]
    for observer in observers:
        terminate = observer._terminate_all  # type: ignore[attr-defined]

        def say_then_terminate(terminate: "_ObserverCallable[[], None]" = terminate) -> None:
            try:
                say()
            finally:
                terminate()

        shadow(observer, {"_terminate_all": say_then_terminate})
    return bool(observers)
