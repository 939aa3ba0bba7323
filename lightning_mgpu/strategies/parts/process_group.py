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

**``init_process_group`` called as Lightning calls it.** The loopback server is not handed to
``init_process_group(store=...)``: rank 0 starts it *before* the call as a multi-tenant
``TCPStore`` on ``MASTER_PORT``, and torch's own ``env://`` rendezvous, which asks for a
multi-tenant server on that port, shares the one already running in this process instead of
opening its own on every interface. So the call is exactly stock ``DDPStrategy``'s (backend,
rank, world size, timeout, device), a subclass passes its parent's tests, and if a torch ever
stopped sharing the server, its own would fail to bind the port in use: an error, never a
silent listener on every interface. A ``GLOO_SOCKET_IFNAME`` set here is set only for the call:
gloo reads it when it creates the group's device, so it is removed as soon as
``init_process_group`` returns (or fails), and nothing is left in ``os.environ`` whether or not a
teardown follows (Lightning's own tests call ``setup_environment()`` and ``setup()`` without one). A
group made later with ``torch.distributed.new_group(backend="gloo")`` uses gloo's default
interface (the host name's address) unless you set ``GLOO_SOCKET_IFNAME`` yourself; a value you
set is never touched.

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
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_mgpu.comm.distributed import is_loopback_host, loopback_store, pin_backend_to_loopback

DEFAULT_TIMEOUT = timedelta(minutes=30)


@contextmanager
def rendezvous(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Iterator[Optional[Any]]:
    """Around ``init_process_group``: yields the store to pass as ``store=``, or None (the usual case:
    call it as Lightning does; see the module docstring).

    A store is yielded only under torchrun with restarts (each attempt's key prefix). With
    Lightning's own environment and a loopback ``MASTER_ADDR``, rank 0's loopback-only server
    runs for the duration of the block (torch's store shares it from then on).
    """
    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        yield None
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        yield attempt_store(environment, world_size, timeout)
        return
    server = None
    try:
        if type(environment) is LightningEnvironment:
            server = loopback_only_store(environment, global_rank, world_size, timeout, backend)
        yield None
    finally:
        del server  # torch's store holds the shared server now (or nothing does: the port is closed)
        restore_environment()  # gloo has read GLOO_SOCKET_IFNAME by now: set for the call only


def attempt_store(environment: Any, world_size: int, timeout: Optional[timedelta]) -> Any:
    """torchrun's agent store, under a key prefix of this restart attempt."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    client = torch.distributed.TCPStore(
        environment.main_address,
        int(environment.main_port),
        world_size,
        False,
        timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
    )  # fmt: skip  (one call kept on two lines: the positional arguments read as TCPStore's signature)
    return torch.distributed.PrefixStore(f"lightning_mgpu/attempt_{attempt}", client)


def loopback_only_store(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Optional[Any]:
    """On rank 0: the rendezvous server, a multi-tenant ``TCPStore`` listening on loopback only, when
    ``MASTER_ADDR`` is a loopback address (or a name such as ``localhost`` that resolves only to
    loopback addresses); else None. Every rank pins gloo to the loopback interface then.

    Other ranks get None: torch's ``env://`` rendezvous connects to rank 0's server as a client.
    """
    host = environment.main_address
    if not is_loopback_host(host):
        return None
    port = int(environment.main_port)
    if "gloo" in backend:
        variable = pin_backend_to_loopback("gloo")
        if variable is not None:
            _VARIABLES_SET.append(variable)
    if global_rank != 0:
        return None
    try:
        # multi_tenant: torch's env:// rendezvous asks for a shared server on this port and gets this one;
        # no wait for the workers here: torch's own store counts them.
        return loopback_store(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
            wait_for_workers=False,
            multi_tenant=True,
        )
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
    """Remove the variables the rendezvous set (the backend read them when the group was created)."""
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
