"""The world a launcher started this process in (``torchrun``, or SLURM's ``srun``), and joining it.

A command of ours started once per rank by a launcher must not act as if it were alone (run
its own processes on 127.0.0.1, or print one report per rank): :func:`launched_world` reads
the launcher's variables and says which world this process belongs to, and :func:`join` makes
the process group of that world, through the rendezvous a Lightning fit in the same job uses:

* **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``): torch's ``env://`` rendezvous (the agent's store). torchrun
  inside a SLURM job is torchrun's world: its variables win.
* **srun** (``SLURM_STEP_ID`` set: a task of a job step, not the batch script; ``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NUM_NODES``,
  ``SLURM_STEP_NODELIST``): a ``TCPStore`` on the step's first node, at ``MASTER_PORT`` if set, else
  at Lightning's port for the job (``15000`` + the job id's last four digits), which is where
  Lightning's ``SLURMEnvironment`` meets.

One rank (or none of these variables) is no launched world: ``launched_world`` returns None.
No import of Lightning here (this module sits below strategies and callbacks).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

__all__ = ["LaunchedWorld", "first_host", "join", "launched_world"]


@dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in the world its launcher started."""

    launcher: str
    """``"torchrun"`` or ``"srun"``."""
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int

    @property
    def hostname(self) -> str:
        return socket.gethostname()


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[03-05,7],gpu1`` -> ``node03`` (zero padding kept)."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first item: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", item)
    if match is None:
        return item
    first = re.split(r"[,-]", match.group(2))[0]
    return f"{match.group(1)}{first}{match.group(3)}"


def _integer(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> int:
    value = environ.get(name)
    if value is None or not value.strip():
        if default is None:
            raise ValueError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def launched_world(environ: Mapping[str, str]) -> Optional[LaunchedWorld]:
    """The world of more than one rank a launcher started this process in, or None.

    Raises ``ValueError`` naming the variable when a launcher's variable is malformed.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ and ("LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ):
        world_size = _integer(environ, "WORLD_SIZE")
        if world_size < 2:
            return None
        local_world = _integer(environ, "LOCAL_WORLD_SIZE", world_size)
        return LaunchedWorld(
            launcher="torchrun",
            rank=_integer(environ, "RANK"),
            world_size=world_size,
            local_rank=_integer(environ, "LOCAL_RANK", 0),
            node_rank=_integer(environ, "GROUP_RANK", _integer(environ, "NODE_RANK", 0)),
            nodes=max(1, world_size // max(1, local_world)),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_integer(environ, "MASTER_PORT", 29500),
        )
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
        world_size = _integer(environ, "SLURM_STEP_NUM_TASKS", _integer(environ, "SLURM_NTASKS", 1))
        if world_size < 2:
            return None
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job = environ.get("SLURM_JOB_ID", "0")
        default_port = 15000 + int(job[-4:]) if job[-4:].isdigit() else 29500  # Lightning's SLURMEnvironment rule
        return LaunchedWorld(
            launcher="srun",
            rank=_integer(environ, "SLURM_PROCID"),
            world_size=world_size,
            local_rank=_integer(environ, "SLURM_LOCALID", 0),
            node_rank=_integer(environ, "SLURM_NODEID", 0),
            nodes=_integer(environ, "SLURM_STEP_NUM_NODES", _integer(environ, "SLURM_NNODES", 1)),
            master_addr=environ.get("MASTER_ADDR") or first_host(nodelist),
            master_port=_integer(environ, "MASTER_PORT", default_port),
        )
    return None


def join(world: LaunchedWorld, *, backend: str = "gloo", timeout: timedelta) -> None:
    """Make the default process group of ``world`` (every rank must call it); ``timeout`` bounds the
    rendezvous and every collective after it. Raises what torch raises when a rank does not come."""
    import torch.distributed as dist

    if world.launcher == "torchrun":
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    store = dist.TCPStore(
        world.master_addr, world.master_port, world.world_size, world.rank == 0, timeout=timeout
    )  # fmt: skip
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.world_size, timeout=timeout)
