"""Faster start-up for the processes the test suite starts (on their ``PYTHONPATH``: see ``tests/conftest.py``).

``import lightning`` imports torchmetrics, and torchmetrics imports ``transformers`` (its BERTScore,
InfoLM and CLIP metrics) and ``matplotlib`` (its ``Metric.plot``) whenever they are installed:
``matplotlib`` is one of our dependencies and the test extra installs ``transformers``. On this
project's 2-core machine that was about 1.2 s of the 4.5 s of CPU that importing Lightning takes,
and the suite starts about 280 such processes (its xdist workers included).

This module, run by Python at start-up, lets torchmetrics see those two packages as absent: right
after ``torchmetrics.utilities.imports`` has run, its availability flags for them are set to
False. Nothing else changes: ``import transformers`` and ``import matplotlib`` still work (the
Hugging Face tests and the profiler's plots import them themselves); only torchmetrics' own text,
multimodal and plotting features are off in these processes, and no test uses them. A
``sitecustomize`` that this one hides on the path (a system Python's) still runs, after it.

``MGPU_TEST_FULL_IMPORTS=1`` turns this off.

``MGPU_PROC_LOG=FILE`` (off by default) appends one JSON line per process as it exits: its argv, the
test that started it (``PYTEST_CURRENT_TEST``), its CPU seconds, and whether it imported torch and
Lightning. ``docs/development.md`` says how the suite's CPU was accounted with it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

_TARGET = "torchmetrics.utilities.imports"
_FLAGS = (
    "_TRANSFORMERS_AVAILABLE",
    "_TRANSFORMERS_GREATER_EQUAL_4_4",
    "_TRANSFORMERS_GREATER_EQUAL_4_10",
    "_MATPLOTLIB_AVAILABLE",
)


class _OptionalImportsOff(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torchmetrics.utilities.imports`` to clear the flags after it ran."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        exec_module = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec

        def exec_then_clear(module: ModuleType) -> None:
            exec_module(module)
            for flag in _FLAGS:
                if hasattr(module, flag):
                    setattr(module, flag, False)
            if self in sys.meta_path:  # done: the module is imported once per process
                sys.meta_path.remove(self)

        loader.exec_module = exec_then_clear  # type: ignore[method-assign]
        return spec


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _log_this_process(path: str) -> None:
    import atexit
    import json
    import resource
    import time

    started = [time.time()]
    # a process forked from a warm interpreter (tests/warm.py) starts its own clock; its CPU counters start at 0
    os.register_at_fork(after_in_child=lambda: started.__setitem__(0, time.time()))

    def record() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        entry = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": sys.argv[:6],
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "wall_s": round(time.time() - started[0], 3),
            "torch": "torch" in sys.modules,
            "lightning": "lightning" in sys.modules,
        }
        with open(path, "a") as log:
            log.write(json.dumps(entry) + "\n")

    atexit.register(record)


if os.environ.get("MGPU_PROC_LOG"):
    _log_this_process(os.environ["MGPU_PROC_LOG"])
if os.environ.get("MGPU_TEST_FULL_IMPORTS", "") in ("", "0"):
    sys.meta_path.insert(0, _OptionalImportsOff())
_run_the_next_sitecustomize()
