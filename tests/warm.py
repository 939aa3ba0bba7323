"""Warm starts for the processes the test suite launches: a pre-imported interpreter forks them.

Most of the suite's CPU is processes starting, not training: a process that imports torch and
Lightning spends about 2.7 s of CPU on it on this project's 2-core machine, and a whole run starts
about 270 of them (measured: about 840 of the 1,190 s of CPU its child processes used). Each pytest
worker therefore keeps one *zygote*: a Python process that has imported ``PRELOAD`` once, is
otherwise idle and single-threaded, and forks a child for each ``python SCRIPT ARGS`` or
``python -m MODULE ARGS`` the tests start. The child sets itself up as the interpreter would have
(own session, the given working directory, environment, ``sys.argv``, ``sys.path[0]``, standard
streams; ``__main__`` run by ``runpy``) and runs the script; the test gets a ``Popen``-like handle
(pid, exit code or ``-SIGNAL``, pipes, ``communicate``/``wait``/``poll`` with timeouts, signals).

Only the top-level process is warm. Whatever it starts itself (the other ranks from Lightning's
launcher, torchrun's workers) starts cold, through the real ``subprocess``/``multiprocessing``
paths those tests are about. A start is cold, as before, when:

* it runs ``-c`` code or anything but a script or ``-m`` (the tests of what importing does);
* its output is not read through pipes (stdout piped; stderr piped or merged into it);
* its environment differs from the zygote's in a variable read while the interpreter or the
  preloaded libraries start (``START_PREFIXES``, ``PYTHONPATH`` included);
* the caller asks for it (``start(..., cold=True)``, ``run_python(..., cold=True)``): the tests of
  launching itself (Lightning's launcher and torchrun under failures and preemption, the labs) start
  their processes exactly as a user's shell does;
* ``MGPU_TEST_COLD=1`` is set (everything cold: the suite as it ran before this module).

Differences a test could see, none of which any test relies on: the preloaded modules are in
``sys.modules`` before the script runs; stdin is ``/dev/null``; the child is always a session
leader; Python's hash seed is the zygote's.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Sequence, Union

PRELOAD = ("torch", "lightning.pytorch", "lightning_mgpu")
START_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "LD_",
    "MALLOC_",
    "CUDA_",
    "TORCH",
    "PL_",
    "LIGHTNING_",
    "MGPU_TEST",
)
"""Environment variables that act when an interpreter or a preloaded library starts: a request whose
value for any of them differs from the zygote's starts cold."""
COLD = "MGPU_TEST_COLD"
_HEADER = struct.Struct("!I")
_POLL_S = 0.02


# ----------------------------------------------------------------------------- the zygote (its own process)
def _serve(path: str) -> Optional[tuple[dict[str, Any], list[int]]]:
    """Accept requests and fork a child per request; report each child's exit status on its connection.

    Returns in a forked child only (its request and its stdio fds); the zygote itself returns
    ``None`` when the process that started it is gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    null = os.open(os.devnull, os.O_WRONLY)  # nothing more for the worker, which reads no further
    os.dup2(null, 1)
    os.close(null)
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], _POLL_S)
        if readable:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as error:  # a client gone mid-request: nothing to start
                print(f"test zygote: bad request: {error!r}", file=sys.stderr)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in running.values():
                    other.close()
                conn.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{pid}\n".encode())
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()
    return None


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the request was cut short")
        body += chunk
    return json.loads(body), list(fds)


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: set up what ``python ARGV`` would have, then run it as ``__main__``."""
    import runpy

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv: list[str] = request["argv"]
    if argv[0] == "-m":
        sys.path[0] = os.getcwd()
        sys.argv = argv[1:]  # runpy replaces argv[0] with the module's file, as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


# ----------------------------------------------------------------------------- the client (in the pytest worker)
class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.dir = tempfile.mkdtemp(prefix="mgpu_zygote_")
        self.path = os.path.join(self.dir, "sock")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", self.path],
            cwd=Path(__file__).resolve().parents[1],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            self.process.kill()
            self.process.stdout.close()
            raise RuntimeError(f"the test zygote did not start (exit {self.process.wait()})")
        self.process.stdout.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.dir)


_lock = threading.Lock()
_zygote: Optional[_Zygote] = None
_unavailable: Optional[str] = None


def _start_time_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(START_PREFIXES)}


def _zygote_for(env: Mapping[str, str]) -> Optional[_Zygote]:
    """The worker's zygote (started on first use) if a process with ``env`` can start warm, else None."""
    global _zygote, _unavailable
    if _unavailable or os.environ.get(COLD, "") not in ("", "0") or env.get(COLD, "") not in ("", "0"):
        return None
    from tests.conftest import cpu_env

    base = cpu_env()  # what the zygote starts with: the suite's children's environment
    if _start_time_env(base) != _start_time_env(env):
        return None
    with _lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is not None:
                _zygote.close()
            try:
                _zygote = _Zygote(base)
            except (OSError, RuntimeError) as error:  # e.g. a TMPDIR too long for a socket path: cold, as before
                _unavailable = f"no warm starts in this worker: {error}"
                warnings.warn(f"tests/warm.py: {_unavailable}; every process starts cold", stacklevel=2)
                return None
            atexit.register(_zygote.close)
        return _zygote


def _request(zygote: _Zygote, argv: list[str], cwd: str, env: Mapping[str, str], fds: list[int]) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(zygote.path)
    body = json.dumps({"argv": argv, "cwd": cwd, "env": dict(env)}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body))], fds)
    conn.sendall(body)
    return conn


class WarmProcess:
    """What the tests use of ``subprocess.Popen``, for a process the zygote forked."""

    def __init__(
        self,
        zygote: _Zygote,
        argv: list[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stderr: Any,
        text: bool,
    ) -> None:
        self.args = [sys.executable, *argv]
        self.returncode: Optional[int] = None
        self._text = text
        # stdout is a pipe; stderr a pipe of its own or the same one (``start`` sends anything else cold)
        null_in = os.open(os.devnull, os.O_RDONLY)
        out_read, out_fd = os.pipe()
        own = [null_in, out_fd]  # the child's ends, closed here once sent
        err_read: Optional[int] = None
        err_fd = out_fd
        if stderr == subprocess.PIPE:
            err_read, err_fd = os.pipe()
            own.append(err_fd)
        try:
            self._conn = _request(zygote, argv, cwd, env, [null_in, out_fd, err_fd])
        finally:
            for fd in own:
                os.close(fd)
        self.stdout: Optional[IO[Any]] = os.fdopen(out_read, "rb")
        self.stderr: Optional[IO[Any]] = os.fdopen(err_read, "rb") if err_read is not None else None
        self._status = self._conn.makefile("rb")
        line = self._status.readline()
        if not line:
            raise RuntimeError("the test zygote did not start the process")
        self.pid = int(line)
        self._chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

    # exit status
    def _read_status(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if ready:
                line = self._status.readline()
                # a zygote gone before the child ended cannot say how it ended: as killed
                self.returncode = int(line) if line else -signal.SIGKILL
                self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._read_status(0)

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def communicate(self, input: None = None, timeout: Optional[float] = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        names = {"stdout": self.stdout, "stderr": self.stderr}
        streams = {s.fileno(): name for name, s in names.items() if s is not None and not s.closed}
        while streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(streams), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    self._chunks[streams[fd]].append(data)
                else:
                    names[streams.pop(fd)].close()  # type: ignore[union-attr]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return self._output("stdout"), self._output("stderr")

    def _output(self, name: str) -> Any:
        if getattr(self, name) is None:
            return None
        data = b"".join(self._chunks[name])
        return data.decode(errors="replace") if self._text else data

    # signals
    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def start(
    command: Sequence[str],
    *,
    cwd: Union[str, Path],
    env: Optional[Mapping[str, str]] = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    cold: bool = False,
) -> Union[WarmProcess, subprocess.Popen[Any]]:
    """``subprocess.Popen(command, cwd=..., env=..., start_new_session=True, ...)``, forked warm when it can be.

    ``command`` starts with ``sys.executable``; warm for ``SCRIPT ...`` and ``-m MODULE ...`` with stdout piped and
    stderr piped or merged into it, unless ``cold``: the tests of launching itself (launchers, preemption, failures,
    the labs) start their processes as a user's shell does."""
    env = dict(os.environ if env is None else env)
    argv = list(command[1:])
    runnable = (
        command[0] == sys.executable and argv and (argv[0] == "-m" and len(argv) > 1 or not argv[0].startswith("-"))
    )
    piped = stdout == subprocess.PIPE and stderr in (subprocess.PIPE, subprocess.STDOUT)  # how the tests read it
    zygote = _zygote_for(env) if runnable and piped and not cold else None
    if zygote is not None:
        return WarmProcess(zygote, argv, cwd=str(cwd), env=env, stderr=stderr, text=text)
    return subprocess.Popen(
        list(command), cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text, start_new_session=True
    )


if __name__ == "__main__":
    _child = _serve(sys.argv[1])
    if _child is not None:
        _become(*_child)
