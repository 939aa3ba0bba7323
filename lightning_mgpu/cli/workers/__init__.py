"""The programs ``lightning-mgpu`` starts as processes of their own: one module each, run as
``python -m lightning_mgpu.cli.workers.NAME``, named after what it runs.

* :mod:`.selftest`: one path of ``lightning-mgpu doctor --selftest`` (started by :mod:`lightning_mgpu.cli._selftest`);
* :mod:`.allreduce`: one rank of ``lightning-mgpu doctor``'s all_reduce check (:mod:`lightning_mgpu.cli._allreduce`);
* :mod:`.tune`: every rank of ``lightning-mgpu tune``'s sweep, under ``torch.distributed.run`` (:mod:`lightning_mgpu.cli.tune`).

Each module's docstring opens with its command line. :func:`run` is how a command runs one and
waits for it, never longer than its time limit. Standard library only here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["TIMED_OUT", "run"]

TIMED_OUT = 124
""":func:`run`'s exit code for a program stopped at its time limit (as ``timeout(1)``'s)."""


def run(argv: list[str], timeout: float, env: dict[str, str]) -> tuple[int, str]:
    """Run ``argv`` in a session of its own and return its exit code and output (stdout and stderr together).
    At ``timeout`` seconds its whole process group is killed (the ranks it started too): :data:`TIMED_OUT`."""
    child = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()  # (reaps it)
        return TIMED_OUT, output or ""
    return child.returncode, output or ""
