"""Lightning's launchers, with the model checked before any rank starts and the tuned bucket size brought home.

A mistake in the arguments that needs the LightningModule to be seen (e.g. a split module that
does not exist) is one clear error in the launching process rather than one traceback per rank:
:class:`CheckedSubprocessScriptLauncher` (``python train.py``) and :class:`TunedMultiProcessingLauncher`
(spawn/fork) call the strategy's ``check_model`` first. The spawn launcher also returns
``bucket_cap_mb="auto"``'s choice to the launching process, where ``strategy.bucket_cap_mb``
is then the size in force after ``fit`` as well.

Under ``python train.py`` Lightning's child-process observer SIGKILLs the ranks it started and its own
process within 5 s of a child rank's non-zero exit, possibly while the launching process is still busy in its step:
:class:`CheckedSubprocessScriptLauncher` has it name the ended ranks first
(:func:`~lightning_mgpu.strategies.parts.failures.child_ends_namer`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

from typing_extensions import override

from lightning_mgpu._compat.lightning import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    before_children_are_killed,
)
from lightning_mgpu.comm.distributed import lost_peer
from lightning_mgpu.strategies.parts.failures import child_ends_namer, fit_failed_here, launched_children

if TYPE_CHECKING:
    import lightning.pytorch as pl

LAUNCHER_RESULTS_KEY = "lightning_mgpu"


@runtime_checkable
class CheckedStrategy(Protocol):
    """A strategy that checks a LightningModule before its ranks start, and may carry state home."""

    def check_model(self, model: "pl.LightningModule") -> None: ...

    def launcher_results(self) -> Optional[dict[str, Any]]:
        """Plain data rank 0 sends back to the launching process after a spawn (None: nothing)."""

    def adopt_launcher_results(self, results: dict[str, Any]) -> None: ...


def check_before_launch(strategy: Any, args: tuple[Any, ...]) -> None:
    import lightning.pytorch as pl

    model = args[0] if args else None  # fit/validate/test/predict pass the LightningModule first
    if isinstance(strategy, CheckedStrategy) and isinstance(model, pl.LightningModule):
        strategy.check_model(model)


class CheckedSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Lightning's launcher for ``python train.py``: the strategy checks the model before the other ranks start, and
    Lightning's child-process observer names an ended rank before it kills the job (see the module docstring)."""

    def __init__(self, strategy: CheckedStrategy, *args: Any) -> None:
        super().__init__(*args)
        self.checked_strategy = strategy

    @override
    def launch(
        self, function: Callable[..., Any], *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any
    ) -> Any:
        if not self.cluster_environment.creates_processes_externally:  # this process starts the others
            check_before_launch(self.checked_strategy, args)
            function = self._naming_ended_children(function)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _naming_ended_children(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function``, first installing the namer on the observer Lightning starts just before calling it. An error
        of this process's own (not a collective failed by a lost peer) silences the namer before Lightning's
        exception handling runs: its children end because of it."""

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                rank = self.cluster_environment.node_rank() * self.num_processes  # this process is local rank 0
                before_children_are_killed(self.procs, child_ends_namer(rank, launched_children(self, rank)))
            except Exception as error:  # noqa: BLE001 - a note's set-up never fails the fit; Lightning's line remains
                warnings.warn(
                    f"lightning_mgpu: ended ranks will not be named before Lightning kills the job ({error})",
                    stacklevel=2,
                )
            try:
                return function(*args, **kwargs)
            except BaseException as error:
                if not lost_peer(error):
                    fit_failed_here()
                raise

        return run


class TunedMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, checking the model before it starts the ranks and returning
    the strategy's :meth:`~CheckedStrategy.launcher_results` to the launching process."""

    def __init__(self, strategy: CheckedStrategy, *, start_method: str) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self.checked_strategy = strategy

    @override
    def launch(
        self, function: Callable[..., Any], *args: Any, trainer: Optional["pl.Trainer"] = None, **kwargs: Any
    ) -> Any:
        check_before_launch(self.checked_strategy, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def get_extra_results(self, trainer: "pl.Trainer") -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        strategy = trainer.strategy
        if isinstance(strategy, CheckedStrategy):
            results = strategy.launcher_results()
            if results is not None:
                extra[LAUNCHER_RESULTS_KEY] = results
        return extra

    @override
    def update_main_process_results(self, trainer: "pl.Trainer", extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        results = extra.get(LAUNCHER_RESULTS_KEY)
        strategy = trainer.strategy
        if isinstance(results, dict) and isinstance(strategy, CheckedStrategy):
            strategy.adopt_launcher_results(results)


def checked_launcher(strategy: Any, launcher: Any) -> Any:
    """Our version of the launcher Lightning picked (``launcher``), or ``launcher`` itself."""
    if type(launcher) is MultiProcessingLauncher:  # spawn / fork: bring the tuned size home
        return TunedMultiProcessingLauncher(strategy, start_method=strategy.start_method)
    if type(launcher) is SubprocessScriptLauncher:  # `python train.py`: check the model before starting ranks
        return CheckedSubprocessScriptLauncher(
            strategy, launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
        )
    return launcher
