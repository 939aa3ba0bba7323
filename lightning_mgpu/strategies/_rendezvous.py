"""Rendezvous stores that torch's defaults get wrong for us.

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
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.environments import LightningEnvironment

DEFAULT_TIMEOUT = timedelta(minutes=30)


def rendezvous_store(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Optional[Any]:
    """A store for ``init_process_group(store=...)``, or None for torch's own rendezvous."""
    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return _attempt_store(environment, world_size, timeout)
    if type(environment) is LightningEnvironment:
        return _loopback_store(environment, global_rank, world_size, timeout, backend)
    return None


def _attempt_store(environment: Any, world_size: int, timeout: Optional[timedelta]) -> Any:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    client = torch.distributed.TCPStore(
        environment.main_address, int(environment.main_port), world_size, False,
        timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
    )  # fmt: skip
    return torch.distributed.PrefixStore(f"lightning_mgpu/attempt_{attempt}", client)


def _loopback_store(
    environment: Any, global_rank: int, world_size: int, timeout: Optional[timedelta], backend: str
) -> Optional[Any]:
    """A ``TCPStore`` bound to loopback when ``MASTER_ADDR`` is a loopback address, else None."""
    host = environment.main_address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    port = int(environment.main_port)
    timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
    if "gloo" in backend and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = _loopback_interface()
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    store_class = torch.distributed.TCPStore
    if global_rank != 0:
        return store_class(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(max(128, world_size))
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"rank 0 cannot listen on {host}:{port} for the rendezvous ({error}): another job may use "
            f"MASTER_PORT={port}; pick a free port or unset MASTER_PORT"
        ) from None
    fd = listener.detach()  # the store owns the socket from here on
    try:
        return store_class(host, port, world_size, True, timeout=timeout, master_listen_fd=fd)
    except TypeError:  # a torch without master_listen_fd: its own rendezvous
        os.close(fd)
        return None


def _loopback_interface() -> Optional[str]:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return next((name for name in ("lo", "lo0") if name in names), None)
