"""A SLURM lab on one machine: a real scheduler (Debian's ``slurm-wlm`` + ``munge``) over the network lab's nodes.

Users go from one machine to many through SLURM; this lab runs the package under the real
thing, on one machine, in about a second:

* the nodes are :class:`bench.labs.network.Lab`'s (one network namespace each, a veth pair
  between two, loopback-range addresses ``127.78.0.<i+1>`` with ``route_localnet=1``, the link
  shaped by ``tbf``), named ``slab-<pid>-<random>-n<i>``: this module adds only the daemons;
* ``munged`` with a key of its own (its socket, key and logs in the cluster's directory, never
  the machine's ``/etc/munge``), ``slurmctld`` and one ``slurmd`` per node, each started with
  ``nsenter --net=/run/netns/NODE unshare --uts --mount`` (its own host name, and a hosts file
  naming every node bind-mounted on ``/etc/hosts``; ``ip netns exec`` remounts ``/sys`` and
  ``slurmd`` then dies: "No filesystem mounted on /sys/fs/cgroup");
* the settings that make it work without cgroups and fast enough for tests:
  ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres`` (``CR_CPU``: jobs run side by
  side), ``SlurmdParameters=config_overrides`` (more CPUs declared than the machine has, so
  several tests' jobs run at once), ``AuthInfo=cred_expire=5`` (the least SLURM accepts) and
  ``SchedulerParameters=sched_interval=2,bf_interval=1``: a requeued job starts again ~7 s later
  instead of ~2 minutes; ``KillWait`` is SLURM's default, 30 s;
* every daemon runs under a reaper of its own (``python -m bench.labs.slurm --reap -- DAEMON``,
  a child subreaper): ``slurmd`` detaches each ``slurmstepd``, and where PID 1 reaps nothing (this
  workplace's VMs) every finished job step would otherwise stay a zombie;
* clients (``sbatch``, ``scontrol``, ``scancel``, ``squeue``) run inside node 0's network
  namespace with ``SLURM_CONF`` pointing at the cluster's own configuration (:meth:`Cluster.client`).

What a test or benchmark uses (all of it CPU: ``CUDA_VISIBLE_DEVICES=""`` in every job)::

    with Cluster(nodes=2) as cluster:
        done = cluster.run([sys.executable, "train.py"], nodes=2, tasks_per_node=1, timeout=120)
        done.state.state, done.state.exit_code, done.output      # "COMPLETED", 0, the job's output
        job = cluster.srun_job(argv, nodes=2, options=["--signal=USR1@40", "--time=1", "--requeue"])
        job.signal("USR1"); job.requeue(); job.wait(timeout=120).restarts
        cluster.addresses, cluster.hostnames, cluster.network    # the nodes, and the link (a network Lab)
        cluster.torchrun([...], nproc_per_node=2)                # a command for one task per node

Teardown is not optional, as for the network lab: :class:`Cluster` is a context manager,
registers an ``atexit`` handler, and :func:`bench.labs.network.handle_signals` turns
SIGTERM/SIGHUP into an exception so ``finally`` runs. It ends every process in the nodes
(daemons, job steps, the jobs' ranks), deletes the namespaces and the cluster's directory
(configuration, munge key and socket, spool, state). A cluster whose process was killed with
SIGKILL is removed by the next cluster built 10 minutes later, or at once by
``python -m bench.labs.slurm --cleanup`` (:func:`remove_stale`). Building needs root, the
network lab's tools and the SLURM packages: :func:`lab_unavailable` says what is missing and
how to install it (``apt-get install -y slurm-wlm munge``).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

from bench import REPO_ROOT, pythonpath_with_repo
from bench.labs import network
from bench.labs.network import Lab, LabError, Runner, handle_signals, run_command
from lightning_mgpu.envcheck.variables import LAUNCH_VARS

PREFIX = "slab"
PACKAGES = ("slurm-wlm", "munge")
"""What ``apt-get install -y`` needs (Debian/Ubuntu; about 9 MiB)."""
COMMANDS = (
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "scancel",
    "squeue",
    "sinfo",
    "munged",
    "nsenter",
    "unshare",
    "mount",
)
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
"""Job states a job never leaves (a requeued job goes back to PENDING instead)."""
START_TIMEOUT_S = 30.0
_DIRECTORY = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+$")
_LAUNCH_VARIABLES = (*LAUNCH_VARS, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def lab_unavailable() -> Optional[str]:
    """Why no SLURM lab can be built here (not root, a tool or package missing), or None when it can."""
    reason = network.lab_unavailable()
    if reason is not None:
        return reason
    missing = [command for command in COMMANDS if shutil.which(command) is None]
    if missing:
        return (
            f"the {', '.join(missing)} command(s) are missing: install SLURM and munge as root "
            f"(apt-get install -y {' '.join(PACKAGES)}; util-linux for nsenter/unshare)"
        )
    return None


def remove_stale(runner: Runner = run_command, *, min_age_s: float = 0.0) -> list[str]:
    """Remove what clusters of killed processes left: their nodes (namespaces, with every daemon and job in
    them: :func:`bench.labs.network.remove_stale`) and their directories; returns what was removed."""
    removed = network.remove_stale(runner, min_age_s=min_age_s)
    base = Path(tempfile.gettempdir())
    for directory in base.glob(f"{PREFIX}-*"):
        match = _DIRECTORY.match(directory.name)
        if match is None or network._alive(int(match.group(1))):
            continue
        try:
            age = time.time() - directory.stat().st_mtime
        except OSError:
            continue
        if age >= min_age_s:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(str(directory))
    return removed


@dataclass(frozen=True)
class SlurmNode:
    """One node: its SLURM name (also its host name inside the node), its address and its namespace."""

    index: int
    name: str
    address: str
    namespace: str


@dataclass(frozen=True)
class JobState:
    """What ``scontrol show job`` says of a job now."""

    job_id: str
    state: str
    """``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED``, ``TIMEOUT``, ..."""
    exit_code: int
    """The batch script's exit status (0 until it ends)."""
    signal: int
    """The signal that ended the batch script, or 0."""
    restarts: int
    """How many times the job was requeued."""
    reason: str
    fields: dict[str, str] = field(repr=False)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def parse(cls, job_id: str, line: str) -> JobState:
        """From one line of ``scontrol show job -o ID`` (``Key=Value`` pairs; values hold no spaces
        except the last ones, which are not read here)."""
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        code, _, sig = fields.get("ExitCode", "0:0").partition(":")
        return cls(
            job_id=job_id,
            state=fields.get("JobState", "UNKNOWN"),
            exit_code=int(code or 0),
            signal=int(sig or 0),
            restarts=int(fields.get("Restarts", "0") or 0),
            reason=fields.get("Reason", ""),
            fields=fields,
        )


@dataclass(frozen=True)
class Finished:
    """A job waited for: its last state, its output (the batch output file) and the wall time of the wait."""

    state: JobState
    output: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.state.state == "COMPLETED" and self.state.exit_code == 0


class Job:
    """A submitted job: its state, its output, and the ways a scheduler preempts it."""

    def __init__(self, cluster: Cluster, job_id: str, output: Path) -> None:
        self.cluster, self.id, self.output_path = cluster, job_id, output

    def __repr__(self) -> str:
        return f"Job({self.id}, output={str(self.output_path)!r})"

    def state(self) -> JobState:
        return JobState.parse(self.id, self.cluster.client(["scontrol", "show", "job", "-o", self.id]))

    def output(self) -> str:
        """The batch output so far (every attempt of a requeued job: it is opened for appending)."""
        try:
            return self.output_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float, *, poll_s: float = 0.5) -> Finished:
        """Wait until the job ends (a requeued job ends when its last attempt does). Past ``timeout`` the job is
        cancelled and :class:`LabError` raised with the end of its output."""
        started = time.monotonic()
        while True:
            state = self.state()
            if state.done:
                return Finished(state, self.output(), time.monotonic() - started)
            if time.monotonic() - started > timeout:
                self.cancel()
                tail = "\n".join(self.output().splitlines()[-40:])
                raise LabError(
                    f"job {self.id} did not end within {timeout:g} s (last state {state}); cancelled\n{tail}"
                )
            time.sleep(poll_s)

    def wait_until(
        self, predicate: Callable[[], bool], timeout: float, *, what: str = "the condition", poll_s: float = 0.2
    ) -> None:
        """Wait until ``predicate()`` is true; :class:`LabError` (the job cancelled) past ``timeout`` or if the job
        ends first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            state = self.state()
            if state.done or time.monotonic() > deadline:
                if not state.done:
                    self.cancel()
                tail = "\n".join(self.output().splitlines()[-40:])
                raise LabError(f"job {self.id}: {what} not reached (state {state.state}, {timeout:g} s)\n{tail}")
            time.sleep(poll_s)

    def signal(self, name: str = "USR1") -> None:
        """``scancel --signal=NAME``: the signal to every task of the job's steps (not the batch shell)."""
        self.cluster.client(["scancel", f"--signal={name}", self.id])

    def requeue(self) -> None:
        """``scontrol requeue``: SLURM stops the job (SIGTERM, ``KillWait`` seconds later SIGKILL) and queues it again."""
        self.cluster.client(["scontrol", "requeue", self.id])

    def cancel(self) -> None:
        try:
            self.cluster.client(["scancel", self.id])
        except LabError:
            pass


class Cluster:
    """A SLURM cluster of ``nodes`` nodes on this machine; build with ``with Cluster() as cluster:`` (always torn down).

    Args:
        nodes: how many nodes (network namespaces), each with its ``slurmd``; node 0 runs ``slurmctld`` too.
        cpus: CPUs each node declares (more than the machine has: jobs of several tests run side by side).
        gbps: the link's rate (see :class:`bench.labs.network.Lab`).
        kill_wait: seconds between SLURM's SIGTERM and SIGKILL when it stops a job (``KillWait``).
        cred_expire: seconds a job credential lives; a requeued job waits that long before it starts again.
        runner: runs ``ip``/``tc`` (tests of the configuration pass a fake one; nothing is started then).
    """

    def __init__(
        self,
        nodes: int = 2,
        *,
        cpus: int = 8,
        gbps: Union[float, Sequence[float]] = 10.0,
        kill_wait: int = 30,
        cred_expire: int = 5,
        runner: Runner = run_command,
    ) -> None:
        self.network = Lab(nodes, gbps, runner=runner, prefix=PREFIX)
        self.tag = self.network.tag
        self.runner = runner
        self.cpus, self.kill_wait, self.cred_expire = cpus, kill_wait, cred_expire
        short = self.tag.rsplit("-", 1)[1]
        self.name = f"{PREFIX}{short}"
        self.nodes = [
            SlurmNode(i, f"sl{short}n{i}", self.network.address(i), node.namespace)
            for i, node in enumerate(self.network.nodes)
        ]
        self.directory = Path(tempfile.gettempdir()) / self.tag
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._built = self._torn_down = False

    # ------------------------------------------------------------------ addresses and files

    @property
    def addresses(self) -> list[str]:
        """Every node's address, node 0 first (loopback range, reachable from every node)."""
        return [node.address for node in self.nodes]

    @property
    def hostnames(self) -> list[str]:
        """Every node's host name (its SLURM node name), node 0 first; each resolves inside every node."""
        return [node.name for node in self.nodes]

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.directory / "munge" / "socket"

    def configuration(self) -> str:
        """``slurm.conf``: see the module docstring for why each setting."""
        d = self.directory
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.nodes[0].name}({self.nodes[0].address})",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd.%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd.%n.log",
            f"PlugStackConfig={d}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            "MinJobAge=3600",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
        ]
        lines += [
            f"NodeName={node.name} NodeAddr={node.address} NodeHostname={node.name} CPUs={self.cpus} State=UNKNOWN"
            for node in self.nodes
        ]
        lines.append("PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def hosts(self) -> str:
        """The hosts file every node sees on ``/etc/hosts``: each node's name at its address."""
        return "127.0.0.1 localhost\n" + "".join(f"{node.address} {node.name}\n" for node in self.nodes)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Cluster:
        if not self._built:
            self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def build(self) -> Cluster:
        """Nodes, munge, slurmctld and every slurmd, up and idle; on any failure everything made is removed."""
        if self._built or self._torn_down:
            raise LabError(f"cluster {self.tag} was already built; make a new Cluster")
        real = self.runner is run_command
        reason = lab_unavailable() if real else None
        if reason is not None:
            raise LabError(f"cannot build the SLURM lab: {reason}")
        self._built = True
        atexit.register(self.teardown)
        try:
            if real:
                remove_stale(self.runner, min_age_s=600)
            self.network.build()
            self._write_files()
            if real:
                self._start_daemons()
        except BaseException:
            self.teardown()
            raise
        return self

    def _write_files(self) -> None:
        d = self.directory
        d.mkdir(mode=0o700)
        for sub in ("state", "spool", "jobs", "logs", "munge"):
            (d / sub).mkdir(mode=0o700)
        for node in self.nodes:
            (d / "spool" / node.name).mkdir(mode=0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.conf.write_text(self.configuration())
        (d / "plugstack.conf").write_text("")
        (d / "hosts").write_text(self.hosts())

    def _start(self, label: str, node: SlurmNode, command: str) -> None:
        """``command`` (a shell line) as a daemon inside ``node``, under its own reaper."""
        inner = f"hostname {node.name} && mount --bind {self.directory / 'hosts'} /etc/hosts && exec {command}"
        argv = ["nsenter", f"--net=/run/netns/{node.namespace}", "unshare", "--uts", "--mount"]
        argv += [sys.executable, "-m", "bench.labs.slurm", "--reap", "--", "sh", "-c", inner]
        log = open(self.directory / "logs" / f"{label}.log", "wb")
        with log:
            child = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.client_env(), "PYTHONPATH": pythonpath_with_repo()},
                cwd=REPO_ROOT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the lab's process, which tears down
            )
        self._daemons.append((label, child))

    def _start_daemons(self) -> None:
        d, first = self.directory, self.nodes[0]
        munged = (
            f"munged --foreground --force --socket={self.munge_socket} --key-file={d}/munge/munge.key "
            f"--pid-file={d}/munge/munged.pid --log-file={d}/munge/munged.log --seed-file={d}/munge/munged.seed"
        )
        self._start("munged", first, munged)
        self._wait_for(lambda: self.munge_socket.exists(), "munged's socket")
        self._start("slurmctld", first, "slurmctld -D")
        for node in self.nodes:
            self._start(f"slurmd-{node.name}", node, f"slurmd -D -N {node.name}")
        self._wait_for(self._all_idle, "every node idle")

    def _all_idle(self) -> bool:
        try:
            states = self.client(["sinfo", "--noheader", "--node", ",".join(self.hostnames), "-o", "%N %T"])
        except LabError:
            return False
        idle = {name for line in states.splitlines() for name in _expand(line.split()[0]) if line.split()[1] == "idle"}
        return idle >= set(self.hostnames)

    def _wait_for(self, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [(label, child.returncode) for label, child in self._daemons if child.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0][0]} exited with status {dead[0][1]}" if dead else f"not within {timeout:g} s"
                raise LabError(f"SLURM lab {self.tag}: waiting for {what}: {why}\n{self.logs_tail()}")
            time.sleep(0.1)

    def logs_tail(self, lines: int = 15) -> str:
        """The end of every daemon's log: what a failed start or a stuck job shows."""
        parts = []
        for log in sorted(self.directory.glob("*.log")) + sorted((self.directory / "logs").glob("*.log")):
            try:
                text = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def teardown(self) -> None:
        """End every process in the nodes, delete them and the cluster's directory (idempotent; never raises)."""
        if self._torn_down:
            return
        self._torn_down = True
        reapers = {child.pid for _, child in self._daemons}
        for node in self.nodes:  # daemons, job steps, ranks; the reapers collect them, then end themselves
            for pid in _namespace_pids(node.namespace, self.runner):
                if pid not in reapers:
                    _kill(pid)
        deadline = time.monotonic() + 5
        for _, child in self._daemons:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(child.pid)
                child.wait()
        self._daemons = []
        self.network.teardown()
        shutil.rmtree(self.directory, ignore_errors=True)
        try:
            atexit.unregister(self.teardown)
        except Exception:  # interpreter shutting down
            pass

    # ------------------------------------------------------------------ clients and jobs

    def client_env(self, extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment of client commands, and so of every job (``sbatch`` exports it): this cluster's
        ``SLURM_CONF``, the repository importable, one thread per rank, no GPU, W&B offline; no variable of
        a surrounding launcher or SLURM job."""
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in _LAUNCH_VARIABLES and not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
        }
        env.update(
            SLURM_CONF=str(self.conf),
            PYTHONPATH=pythonpath_with_repo(),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            WANDB_MODE="offline",
        )
        env.update(extra or {})
        return env

    def client_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as a client inside node 0 (where ``slurmctld`` listens)."""
        return ["nsenter", f"--net=/run/netns/{self.nodes[0].namespace}", *argv]

    def client(self, argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None, timeout: float = 60) -> str:
        """Run a client command (``scontrol``, ``sbatch``, ...) against this cluster; its stdout, or :class:`LabError`."""
        try:
            done = subprocess.run(
                self.client_argv(argv),
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.client_env(env),
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise LabError(f"{' '.join(argv)}: {error}") from None
        if done.returncode != 0:
            raise LabError(f"{' '.join(argv)} failed (exit code {done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def submit(
        self,
        script: str,
        options: Sequence[str] = (),
        *,
        args: Sequence[str] = (),
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        name: str = "lab",
    ) -> Job:
        """``sbatch`` a batch script (its text; ``#SBATCH`` lines are read as usual, ``options`` override them;
        ``args`` are the script's own arguments).

        The job runs in ``workdir`` (default: the cluster's ``jobs/``), its output appended to
        ``<workdir>/<cluster name>-<job id>.out`` across requeues (job ids restart at 1 in every cluster); the job's environment is :meth:`client_env` plus ``env``.
        """
        workdir = Path(workdir or self.directory / "jobs").resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        path = self.directory / "jobs" / f"{name}-{secrets.token_hex(4)}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        argv = ["sbatch", "--parsable", f"--job-name={name}", f"--chdir={workdir}", "--open-mode=append"]
        argv += [f"--output={workdir}/{self.name}-%j.out", *options, str(path), *args]
        job_id = self.client(argv, env=env).strip().split(";")[0]
        if not job_id.isdigit():
            raise LabError(f"sbatch gave no job id: {job_id!r}")
        return Job(self, job_id, workdir / f"{self.name}-{job_id}.out")

    def srun_job(
        self,
        command: Sequence[str],
        *,
        nodes: Optional[int] = None,
        tasks_per_node: int = 1,
        options: Sequence[str] = (),
        srun_options: Sequence[str] = (),
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        name: str = "lab",
    ) -> Job:
        """Submit ``command`` as a job on ``nodes`` nodes (default: all) with ``tasks_per_node`` tasks on each
        (``srun`` inside a batch script, so the job can be signalled and requeued as on a real cluster)."""
        count = len(self.nodes) if nodes is None else nodes
        script = f"srun --kill-on-bad-exit=1 {shlex.join(srun_options)} {shlex.join(command)}\n"
        layout = [f"--nodes={count}", f"--ntasks-per-node={tasks_per_node}"]
        return self.submit(script, [*layout, *options], workdir=workdir, env=env, name=name)

    def run(
        self,
        command: Sequence[str],
        *,
        nodes: Optional[int] = None,
        tasks_per_node: int = 1,
        timeout: float = 120,
        options: Sequence[str] = (),
        workdir: Optional[Path] = None,
        env: Optional[Mapping[str, str]] = None,
        name: str = "lab",
    ) -> Finished:
        """Run ``command`` as a job on ``nodes`` nodes x ``tasks_per_node`` tasks and wait for it (see :meth:`srun_job`)."""
        job = self.srun_job(
            command, nodes=nodes, tasks_per_node=tasks_per_node, options=options, workdir=workdir, env=env, name=name
        )
        return job.wait(timeout)

    def torchrun(self, target: Sequence[str], *, nproc_per_node: int, port: int = 29400) -> list[str]:
        """A command that, run as one task per node (:meth:`run` with ``tasks_per_node=1``), starts ``target``
        under ``torchrun`` on every node of the job: node rank from ``SLURM_NODEID``, node 0 of the job as the
        rendezvous (a static one, on ``port``)."""
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        line = (
            f"exec {shlex.join(torchrun)} --nnodes=$SLURM_JOB_NUM_NODES --node-rank=$SLURM_NODEID "
            f"--nproc-per-node={nproc_per_node} --master-addr=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
            f"--master-port={port} --rdzv-backend=static --max-restarts=0 {shlex.join(target)}"
        )
        return ["bash", "-c", line]


def _expand(nodelist: str) -> list[str]:
    """``sl1a2b3cn[0-1]`` -> ``["sl1a2b3cn0", "sl1a2b3cn1"]`` (the forms sinfo prints for this lab's names)."""
    match = re.fullmatch(r"(.*)\[([0-9,\-]+)\]", nodelist)
    if match is None:
        return nodelist.split(",")
    names = []
    for part in match.group(2).split(","):
        low, _, high = part.partition("-")
        names += [f"{match.group(1)}{i}" for i in range(int(low), int(high or low) + 1)]
    return names


def _namespace_pids(namespace: str, runner: Runner) -> list[int]:
    try:
        return [int(p) for p in runner(["ip", "netns", "pids", namespace]).split()]
    except (LabError, ValueError):
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# ----------------------------------------------------------------------------- the daemons' reaper


def reap(argv: Sequence[str]) -> int:
    """Run ``argv`` as a child and reap every process orphaned below it (a child subreaper), until none is left.

    SIGTERM/SIGINT/SIGHUP are passed on to the child. Returns the child's exit status.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    child = subprocess.Popen(list(argv))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: child.send_signal(signum))
    status = None
    while True:
        try:
            pid, code = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(code)
            child.returncode = status
    return 1 if status is None else (128 - status if status < 0 else status)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    target: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, target = args[:split], args[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench.labs.slurm",
        description="A SLURM cluster on this machine (root): run a command as a job on it, or clean up after "
        "killed runs. Example: python -m bench.labs.slurm --nodes 2 --tasks-per-node 1 -- hostname",
    )
    parser.add_argument("--cleanup", action="store_true", help="remove the nodes and files of killed clusters")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the cluster and of the job (2)")
    parser.add_argument("--tasks-per-node", type=int, default=1, help="tasks (ranks) per node (1)")
    parser.add_argument("--gbps", type=float, default=10.0, help="the link's rate in Gbit/s (10)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the job may take (600)")
    parser.add_argument("--reap", action="store_true", help=argparse.SUPPRESS)
    parsed = parser.parse_args(args)
    if parsed.reap:
        return reap(target)
    reason = lab_unavailable()
    if reason is not None:
        print(f"slurm lab: cannot build the SLURM lab: {reason}", file=sys.stderr)
        return 2
    if parsed.cleanup:
        print(f"removed {len(remove_stale())} namespace(s) and directories of killed clusters")
        return 0
    if not target:
        parser.error("give a command after '--' (e.g. -- hostname), or --cleanup")
    handle_signals()
    try:
        with Cluster(parsed.nodes, gbps=parsed.gbps) as cluster:
            done = cluster.run(
                target,
                nodes=parsed.nodes,
                tasks_per_node=parsed.tasks_per_node,
                timeout=parsed.timeout,
                workdir=Path.cwd(),
            )
    except LabError as error:
        print(f"slurm lab: {error}", file=sys.stderr)
        return 1
    print(done.output, end="")
    print(f"slurm lab: job {done.state.job_id} {done.state.state}, exit code {done.state.exit_code}", file=sys.stderr)
    return done.state.exit_code or (0 if done.ok else 1)


if __name__ == "__main__":
    sys.exit(main())
