"""Process-group set-up for our strategies: the rendezvous store, and teardown at exit.

**On one machine, on the loopback interface only.** torch's ``TCPStore`` server (the rendezvous
rank 0 hosts, which every rank connects to first) listens on all interfaces (``::`` /
``0.0.0.0``) whatever ``MASTER_ADDR`` says, and gloo listens on the address the host name
resolves to. Under Lightning's own launcher on one machine, ``MASTER_ADDR`` is a loopback
address (``127.0.0.1`` unless set): no other machine needs to connect, so nothing should listen
where other machines can reach it. Rank 0 binds the store's socket to ``MASTER_ADDR`` itself and
hands it to the store (``master_listen_fd``), and gloo is told to use the loopback interface
(``GLOO_SOCKET_IFNAME``, unless already set). Left alone: a ``MASTER_ADDR`` that is not a
loopback address (several machines), every launcher that sets up the rendezvous itself, and
NCCL's own bootstrap sockets.

**Under torchrun, one namespace per restart.** torchrun's workers share the agent's store
(``TORCHELASTIC_USE_AGENT_STORE``), which keeps its keys across ``--max-restarts`` attempts: a rank
of the new attempt that reaches the rendezvous before its peers re-registered reads the dead
attempt's gloo addresses and fails ("connectFullMesh failed ... Connection refused"), so the
restart fails too (torch 2.13, without Lightning as well). Each attempt gets its own key prefix
(``TORCHELASTIC_RESTART_COUNT``), as torch's own rendezvous once did.

**At exit.** Lightning keeps the process group after ``fit`` (``trainer.test`` may follow). With
gloo on CPython 3.11, a group still alive when the interpreter finalizes can abort the process
("terminate called without an active exception"); :func:`destroy_process_group_at_exit` tears it
down from an ``atexit`` handler, while Python is still whole.
"""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta
from typing import Any, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_mgpu.comm.distributed import is_loopback_host, loopback_store, pin_backend_to_loopback

DEFAULT_TIMEOUT = timedelta(minutes=30)


def rendezvous_store(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Optional[Any]:
    """A store for ``init_process_group(store=...)``, or None for torch's own rendezvous."""
    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return attempt_store(environment, world_size, timeout)
    if type(environment) is LightningEnvironment:
        return loopback_only_store(environment, global_rank, world_size, timeout, backend)
    return None


def attempt_store(environment: Any, world_size: int, timeout: Optional[timedelta]) -> Any:
    """torchrun's agent store, under a key prefix of this restart attempt."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    client = torch.distributed.TCPStore(
        environment.main_address, int(environment.main_port), world_size, False,
        timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
    )  # fmt: skip  (one call kept on two lines: the positional arguments read as TCPStore's signature)
    return torch.distributed.PrefixStore(f"lightning_mgpu/attempt_{attempt}", client)


def loopback_only_store(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Optional[Any]:
    """A ``TCPStore`` bound to loopback when ``MASTER_ADDR`` is a loopback address (or a name such as
    ``localhost`` that resolves only to loopback addresses), else None."""
    host = environment.main_address
    if not is_loopback_host(host):
        return None
    port = int(environment.main_port)
    timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
    if "gloo" in backend:
        variable = pin_backend_to_loopback("gloo")
        if variable is not None:
            _VARIABLES_SET.append(variable)
    try:
        return loopback_store(host, port, world_size, is_master=global_rank == 0, timeout=timeout)
    except OSError as error:
        raise RuntimeError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous ({error}): another job may use "
            f"MASTER_PORT={port}; pick a free port or unset MASTER_PORT"
        ) from None
    except TypeError:  # a torch without master_listen_fd: its own rendezvous
        return None


_VARIABLES_SET: list[str] = []
"""Environment variables this module set (``GLOO_SOCKET_IFNAME``), removed by :func:`restore_environment`."""


def restore_environment() -> None:
    """Remove the variables the rendezvous set, so that nothing is left behind after a run (the
    backend read them when the group was created)."""
    while _VARIABLES_SET:
        os.environ.pop(_VARIABLES_SET.pop(), None)


_EXIT_HANDLER_REGISTERED = False


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, before it finalizes (see above)."""
    global _EXIT_HANDLER_REGISTERED
    if _EXIT_HANDLER_REGISTERED:
        return
    _EXIT_HANDLER_REGISTERED = True

    def release() -> None:
        gc.collect()  # DDP wrappers in reference cycles hold the group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(release)
