"""Registers the strategy names with Lightning's ``StrategyRegistry`` without importing Lightning.

``import lightning_mgpu`` must make ``Trainer(strategy="ddp_tuned")`` work (the package's
contract), but importing Lightning takes seconds, and the ``lightning-mgpu`` console script
imports this package too: ``lightning-mgpu --help`` must not pay for Lightning. So
:func:`install` (run by ``import lightning_mgpu``):

* registers at once when Lightning is already imported;
* otherwise puts a finder on ``sys.meta_path`` that registers as soon as the ``lightning``
  package has finished loading, before the statement that imported it returns: no user code
  can read the registry without our names in it.

Registering imports our strategy classes, and they import many modules of this package. If
one of those modules is what pulled Lightning in (``from lightning_mgpu.callbacks import
CommProfiler`` as a script's first import, say), it is half-initialised at that moment, and
importing the strategies from there would fail as a circular import. So the finder also
watches this package's own modules, and registers once the outermost import among them and
Lightning has finished. ``lightning`` is the one Lightning module watched: importing any
``lightning.*`` module imports the ``lightning`` package first, and it imports
``lightning.pytorch`` in full before it finishes. The finder takes itself off
``sys.meta_path`` once the names are registered.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional, Sequence

LIGHTNING = "lightning"
PACKAGE = "lightning_mgpu"


def register_strategies() -> None:
    """Put every strategy name of this package into Lightning's ``StrategyRegistry``.

    Imports Lightning. Safe to call again: the strategies register with ``override=True``.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mgpu.strategies import HybridParallelStrategy, TunedDDPStrategy

    TunedDDPStrategy.register_strategies(StrategyRegistry)
    HybridParallelStrategy.register_strategies(StrategyRegistry)
    for finder in [f for f in sys.meta_path if isinstance(f, RegisterWhenLightningLoads)]:
        finder.stop()


def install() -> None:
    """Register now if Lightning is imported, else as soon as it is (see the module docstring)."""
    if "lightning.pytorch" in sys.modules:
        register_strategies()
    elif not any(isinstance(finder, RegisterWhenLightningLoads) for finder in sys.meta_path):
        sys.meta_path.insert(0, RegisterWhenLightningLoads())


class RegisterWhenLightningLoads(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: it wraps the loaders of ``lightning`` and of this package's modules.

    It counts the bodies of this package's modules running now (imports nest), notes when
    ``lightning`` has loaded, and registers the strategies once both say it is safe.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._looking_up = threading.local()  # names this thread is asking the other finders about
        self._running = 0
        self._lightning_loaded = False
        self._registering = False

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[ModuleSpec]:
        if fullname != LIGHTNING and not fullname.startswith(PACKAGE + "."):
            return None
        names: set[str] = self._looking_up.__dict__.setdefault("names", set())
        if fullname in names:  # another finder asked the import system again: let it answer
            return None
        names.add(fullname)
        try:
            spec = self._find_with_the_other_finders(fullname, path, target)
        finally:
            names.discard(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WatchedLoader(spec.loader, self, is_lightning=fullname == LIGHTNING)
        return spec

    def _find_with_the_other_finders(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType]
    ) -> Optional[ModuleSpec]:
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec  # type: ignore[no-any-return]
        return None

    def module_started(self, *, is_lightning: bool) -> None:
        if not is_lightning:
            with self._lock:
                self._running += 1

    def module_finished(self, *, is_lightning: bool, succeeded: bool) -> None:
        with self._lock:
            if is_lightning:
                self._lightning_loaded = self._lightning_loaded or (succeeded and "lightning.pytorch" in sys.modules)
            else:
                self._running -= 1
            due = self._lightning_loaded and self._running == 0 and not self._registering
            if due:
                self._registering = True  # registering imports our modules, which come back here
        if not due:
            return
        try:
            register_strategies()
        except BaseException:
            with self._lock:
                self._registering = False  # a later import tries again
            if succeeded:
                raise
            # Else the module's own error is on its way up: ours would hide it.

    def stop(self) -> None:
        """Leave ``sys.meta_path``: the names are registered."""
        with self._lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


class _WatchedLoader(importlib.abc.Loader):
    """Runs the real loader's ``exec_module`` between the finder's started/finished calls."""

    def __init__(self, loader: Any, finder: RegisterWhenLightningLoads, *, is_lightning: bool) -> None:
        self._loader = loader
        self._finder = finder
        self._is_lightning = is_lightning

    def create_module(self, spec: ModuleSpec) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._finder.module_started(is_lightning=self._is_lightning)
        succeeded = False
        try:
            self._loader.exec_module(module)
            succeeded = True
        finally:
            self._finder.module_finished(is_lightning=self._is_lightning, succeeded=succeeded)

    def __getattr__(self, name: str) -> Any:
        # get_code, get_source, is_package, get_resource_reader ...: the real loader's
        # (runpy uses get_code for `python -m lightning_mgpu.cli`).
        loader = self.__dict__.get("_loader")
        if loader is None:  # not initialised (a copy being made): no recursion through here
            raise AttributeError(name)
        return getattr(loader, name)
