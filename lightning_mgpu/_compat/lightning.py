"""Private Lightning names, each behind a function of ours with a version guard (see ``_compat``).

Append new shims at the end as self-contained blocks: a ``guarded(...)`` declaration,
then the public function that uses it (with its fallback or a clear error).
"""

from __future__ import annotations

from lightning_mgpu._compat import guarded  # noqa: F401


# ---------------------------------------------------------------------------------------
# DDPStrategy's private extension points, launchers and types (used by strategies/)
# ---------------------------------------------------------------------------------------
from datetime import timedelta as _timedelta
from typing import Any as _Any, Callable as _Callable, Optional as _Optional

import lightning.pytorch as _pl
from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy

_CONFIGURE_LAUNCHER = guarded(
    "lightning.pytorch.strategies", "DDPStrategy._configure_launcher", required=True,
    why="the Trainer asks the strategy for its launcher here; our strategies pick their own",
)  # fmt: skip
_DDP_PRIVATE_STATE = guarded(
    "lightning.pytorch.strategies", "DDPStrategy._get_process_group_backend", required=True,
    why="DDPStrategy keeps its options in private attributes (_ddp_kwargs, _ddp_comm_hook, _ddp_comm_state, "
    "_ddp_comm_wrapper, _timeout, _start_method, _process_group_backend, _launcher); DDPStrategyBase exposes them",
)  # fmt: skip
_MP_LAUNCHER = guarded(
    "lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher", required=True,
    why="Lightning's spawn/fork launcher, subclassed to check the model first and bring the tuned size home",
)  # fmt: skip
_SCRIPT_LAUNCHER = guarded(
    "lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher", required=True,
    why="Lightning's `python train.py` launcher, subclassed to check the model before starting ranks",
)  # fmt: skip
_INIT_DIST = guarded(
    "lightning.fabric.utilities.distributed", "_init_dist_connection", required=True,
    why="Lightning's process-group set-up (environment variables, rank-zero logging) that DDPStrategy calls",
)  # fmt: skip
_STRATEGY_REGISTRY = guarded(
    "lightning.fabric.strategies", "_StrategyRegistry", required=False,
    why="the type of the strategy registry passed to register_strategies (annotation only)",
)  # fmt: skip
_PATH_TYPE = guarded(
    "lightning.fabric.utilities.types", "_PATH", required=False, why="Lightning's path type (annotation only)"
)  # fmt: skip
_SHOULD_ACCUMULATE = guarded(
    "lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._should_accumulate", required=False,
    why="whether the current batch is inside a gradient-accumulation window (re-wraps refuse to run there)",
)  # fmt: skip

from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistryType  # noqa: E402
from lightning.fabric.utilities.distributed import _init_dist_connection  # noqa: E402
from lightning.fabric.utilities.types import _PATH as PathLike  # noqa: E402
from lightning.pytorch.strategies.launchers.multiprocessing import (  # noqa: E402
    _MultiProcessingLauncher as MultiProcessingLauncher,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (  # noqa: E402
    _SubprocessScriptLauncher as SubprocessScriptLauncher,
)


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
