"""The test lanes' rules, and shared helpers for tests that start real processes.

Lanes, by directory (each mirrors the package: ``comm``, ``strategies``, ``placement``, ...):
``tests/unit/`` holds the in-process tests (``make test-fast``, the loop after every edit),
``tests/dist/`` the tests that start processes (marked ``multiprocess`` here, by their directory) and
``tests/bench/`` the benchmarks' smoke runs (marked ``bench``); ``make test`` runs all three. A test
that starts a process (subprocess, torchrun, ``mp.spawn``, Lightning's launcher with ``devices>1``,
the CLI in a child) belongs in ``tests/dist/`` and carries its own ``timeout`` ceiling. These rules
are enforced here rather than trusted: a test under ``tests/unit/`` that starts a process fails
naming the fix, one marked ``multiprocess`` or ``bench`` there, or a test file outside the three
lanes, is a collection error, and so is a ``multiprocess`` test without a ``timeout``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import multiprocessing.process
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional, Sequence

import pytest

from tests import warm

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
RECIPES = REPO / "recipes"
TORCHRUN_2 = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2")
# Markers of tests that may start processes; everything else is the fast lane's.
PROCESS_MARKERS = ("multiprocess", "bench")
LANES = {"unit": None, "dist": "multiprocess", "bench": "bench"}
"""The directories of ``tests/`` that hold test files, and the marker each gives its tests."""


class ProcessStartedInFastTest(RuntimeError):
    """An in-process test started a process: it would slip into the fast lane unnoticed."""


FILE_SECONDS = REPO / "tests" / "file_seconds.json"
"""Seconds each test file took in a measured ``make test`` (``MGPU_RECORD_FILE_SECONDS=1 make test`` rewrites it).

``make test`` runs the files on two pytest-xdist workers, a file at a time each (module fixtures
launch once), longest first: a long file left to the end would keep one worker busy while the
other idles. Only the order depends on these figures: a stale or missing entry costs time, never
a result."""


def _longest_files_first(items: list[pytest.Item]) -> None:
    try:
        seconds: dict[str, float] = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):
        return
    # A stable sort: a file's tests stay together and in their order.
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("MGPU_RECORD_FILE_SECONDS") and "PYTEST_XDIST_WORKER" not in os.environ:
        path = report.nodeid.split("::", 1)[0]
        _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    _free_retired_groups()
    if _file_seconds and not session.config.option.collectonly:
        try:  # a partial run updates its files' entries and keeps the others
            known: dict[str, float] = json.loads(FILE_SECONDS.read_text())
        except (OSError, ValueError):
            known = {}
        measured = {**known, **{path: round(seconds, 1) for path, seconds in _file_seconds.items()}}
        ranked = dict(sorted(measured.items(), key=lambda kv: -kv[1]))
        FILE_SECONDS.write_text(json.dumps(ranked, indent=1) + "\n")


SITE = REPO / "tests" / "_site"
"""Put on the ``PYTHONPATH`` of every process the suite starts (xdist workers too): its ``sitecustomize`` keeps
torchmetrics from importing ``transformers`` and ``matplotlib`` at start-up (about 1.2 s of CPU per process; see
that module)."""


def pytest_configure(config: pytest.Config) -> None:
    """Children inherit this process's environment (``cpu_env`` and the launchers copy it), so they start faster."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])
    # Each pytest-xdist worker computes on its share of the cores: torch's default (a thread per core in
    # every worker) oversubscribes them, and a tiny backward then waits on the other worker's threads.
    # torch is imported where it is needed, not at the top: pytest-xdist's controller process runs no test and
    # would import it for nothing (about 1 s before the workers start).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _lanes_by_directory(items: list[pytest.Item]) -> None:
    """Mark each test by its lane's directory (``LANES``); refuse a test outside the lanes, or one marked to start
    processes in ``tests/unit/`` (it would be left out of ``make test-fast`` by nothing but its marker)."""
    outside, marked_unit = [], []
    for item in items:
        parts = item.nodeid.split("::", 1)[0].split("/")
        if parts[0] != "tests":  # collected from elsewhere (a path given on the command line): not ours to judge
            continue
        lane = parts[1] if len(parts) > 2 else None
        if lane not in LANES:
            outside.append(item.nodeid)
        elif LANES[lane] is not None:
            item.add_marker(str(LANES[lane]))
        elif any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
            marked_unit.append(item.nodeid)
    problems = []
    if outside:
        listed = "\n  ".join(outside)
        problems.append(
            f"{len(outside)} test(s) outside the lanes:\n  {listed}\nmove the file to tests/unit/AREA/ (in-process), "
            "tests/dist/AREA/ (starts processes) or tests/bench/ (a benchmark's smoke run)"
        )
    if marked_unit:
        listed = "\n  ".join(marked_unit)
        problems.append(
            f"{len(marked_unit)} test(s) under tests/unit/ marked to start processes:\n  {listed}\n"
            "move them to tests/dist/AREA/ (tests/bench/ for a benchmark's smoke run), or keep them in-process"
        )
    if problems:
        raise pytest.UsageError("\n".join(problems))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Markers by directory (``LANES``), longest files first (see ``FILE_SECONDS``); a multi-process test without
    its own ceiling could hang the CI lane for the global 300 s default."""
    _lanes_by_directory(items)
    _longest_files_first(items)
    missing = [
        item.nodeid
        for item in items
        if item.get_closest_marker("multiprocess") and not item.get_closest_marker("timeout")
    ]
    if missing:
        listed = "\n  ".join(missing)
        raise pytest.UsageError(
            f"{len(missing)} test(s) marked multiprocess have no timeout ceiling:\n  {listed}\n"
            "add @pytest.mark.timeout(SECONDS) to each (or to the module's pytestmark)"
        )


@pytest.fixture(autouse=True)
def _processes_need_the_multiprocess_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Refuse to start a process from a test not marked ``multiprocess`` (or ``bench``): one in ``tests/unit/``.

    Patched where every start goes through: ``subprocess.Popen`` (``run``, ``check_output``,
    torchrun, Lightning's subprocess launcher), ``multiprocessing`` (``mp.spawn``, Lightning's
    spawn launcher, DataLoader workers) and the raw ``os`` calls. A test that replaces
    ``subprocess.Popen`` with a fake starts nothing and is unaffected.
    """
    if any(request.node.get_closest_marker(name) for name in PROCESS_MARKERS):
        yield
        return

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise ProcessStartedInFastTest(
            f"{request.node.nodeid} starts a process, so it does not belong in the fast lane: move it to "
            "tests/dist/AREA/ (marked multiprocess there) with a @pytest.mark.timeout(SECONDS) ceiling "
            "(or keep it in-process)"
        )

    start_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refuse_but_a_font_scan(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> Any:
        # matplotlib builds its font cache once per machine (its first import of pyplot where no cache is): it
        # asks fc-list, where fontconfig is installed. Not the test's process (seen on a fresh GPU machine).
        if isinstance(args, (list, tuple)) and args and os.path.basename(str(args[0])) == "fc-list":
            return start_child(self, args, *rest, **kwargs)
        refuse()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse_but_a_font_scan)
        patch.setattr(warm, "_request", refuse)  # a warm start forks from the worker's zygote
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                patch.setattr(os, name, refuse)
        yield


@pytest.fixture(autouse=True)
def _lightning_log_levels_restored() -> Iterator[None]:
    """Give back Lightning's logger levels after each test: code run in-process (a worker's
    ``run``, a bench function) may quiet them for its own process, which here is the xdist
    worker's, shared with the test files after it."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)


def cpu_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment for a child run: CPU only, the repo importable, W&B offline, quiet."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        WANDB_MODE="offline",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",  # 2 ranks on 2 cores: one thread each, no oversubscription
    )
    # A launcher's variables leaking in from an outer run would confuse Lightning.
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_python(
    args: Sequence[str],
    *,
    cwd: Path,
    timeout: float,
    env: Optional[dict[str, str]] = None,
    check: bool = True,
    cold: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` (warm where it can be unless ``cold``: ``tests/warm.py``); fail the test with the child's
    output if it hangs, or fails and ``check``."""
    cmd = [sys.executable, *args]
    # Own session: on a timeout the whole process group goes (Lightning's launcher starts
    # the other ranks as children; killing only the direct child would leave them running).
    with warm.start(
        cmd, cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cold=cold
    ) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{stdout or ''}\n{stderr or ''}")
        finally:  # whatever happened, nothing of the run outlives it (e.g. a rank whose parent died)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        pytest.fail(
            f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    return proc


def fit_tiny(tmp_path: Path, *extra: str, timeout: float = 120) -> dict[str, Any]:
    """Run tests/scripts/fit_tiny.py on 2 CPU ranks and return rank 0's report."""
    out = tmp_path / f"fit_{len(list(tmp_path.glob('fit_*.json')))}.json"
    run_python([str(SCRIPTS / "fit_tiny.py"), "--out", str(out), *extra], cwd=tmp_path, timeout=timeout)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_recipe(
    recipe: str, script: str, workdir: Path, *flags: str, launcher: Sequence[str] = (), timeout: float = 240
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run ``recipes/RECIPE/SCRIPT FLAGS --record ...`` on CPU; return rank 0's record and the run."""
    record = workdir / "record.pt"
    script_path = str(RECIPES / recipe / script)
    proc = run_python([*launcher, script_path, *flags, "--record", str(record)], cwd=workdir, timeout=timeout)
    import torch

    result: dict[str, Any] = torch.load(record, weights_only=True)
    return result, proc


# Every group the fixtures below destroy stays referenced until the session ends (then freed on the main thread, after
# a garbage collection). gloo runs a comm hook's callbacks on its worker threads and frees them there; torch's
# powerSGD_hook captures the group in them, and a group freed while they are still around can be destroyed on a
# worker thread of its own, which then joins itself: std::system_error "Resource deadlock avoided", and the pytest
# worker aborts (tests/scripts/group_teardown.py shows it). Freeing at the next test's start was not enough for
# PowerSGD: it aborted 4 runs of 5 that way. An idle one-rank group costs two idle threads.
_RETIRED_GROUPS: list[Any] = []


def destroy_default_group() -> None:
    """``destroy_process_group()``, the group itself kept until the session ends (see ``_RETIRED_GROUPS``)."""
    import torch.distributed as dist

    _RETIRED_GROUPS.append(dist.group.WORLD)
    dist.destroy_process_group()


def _free_retired_groups() -> None:
    gc.collect()
    _RETIRED_GROUPS.clear()
    gc.collect()


@pytest.fixture
def one_rank(clean_process: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An in-process one-device fit (Lightning's DDP as rank 0 of 1): no launcher variable of an earlier run in
    the environment; the process group and the environment undone after (``clean_process``)."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def no_gpu_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees the machine as one without a GPU (torch's CUDA queries, nvidia-smi for the doctor), so a
    test of CPU behaviour asserts the same on a GPU machine: there ``nn.DataParallel`` would move a test model to
    ``cuda:0``, the doctor would report the idle GPU and run nvidia-smi, the CLIs would pick CUDA by default."""
    import torch

    from lightning_mgpu.envcheck import checks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(checks, "_nvidia_smi", lambda timeout=5.0: None)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real one-rank gloo group in this process (an in-memory store: no socket, no process)."""
    import torch.distributed as dist
    from datetime import timedelta

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        destroy_default_group()


@pytest.fixture
def clean_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Lightning's DDP on one device (an in-process fit) leaves the process group up and its launcher's
    variables in ``os.environ``: undone after the test, so the next one sees a clean process."""
    import torch.distributed as dist

    environ = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized() and "one_rank_group" not in request.fixturenames:
        destroy_default_group()
    os.environ.clear()
    os.environ.update(environ)
