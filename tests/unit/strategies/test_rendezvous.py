"""The rendezvous our strategies use on one machine: loopback only, by address or by name; nothing left behind."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_mgpu.comm import distributed
from lightning_mgpu.strategies.parts import process_group


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.78.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_loopback_hosts_are_recognised_by_address_and_by_name(host: str, loopback: bool) -> None:
    assert distributed.is_loopback_host(host) is loopback


def test_a_name_that_also_resolves_elsewhere_is_not_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distributed, "resolve_host", lambda host: ["127.0.1.1", "192.0.2.7"])
    assert not distributed.is_loopback_host("myhost")


def _environment(monkeypatch: pytest.MonkeyPatch, host: str) -> LightningEnvironment:
    monkeypatch.setenv("MASTER_ADDR", host)
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    return LightningEnvironment()


def test_master_addr_localhost_gets_a_store_listening_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[tuple[str, int]] = []
    real_bind = distributed.bind_listener

    def recording_bind(host: str, port: int, backlog: int = 128) -> socket.socket:
        bound.append((host, port))
        return real_bind(host, port, backlog)

    monkeypatch.setattr(distributed, "bind_listener", recording_bind)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    environment = _environment(monkeypatch, "localhost")
    store: Any = process_group.loopback_only_store(environment, 0, 1, timedelta(seconds=10), "gloo")
    try:
        assert store is not None, "MASTER_ADDR=localhost must get the loopback-only store"
        assert bound == [("127.0.0.1", environment.main_port)]
        store.set("key", "value")
        assert store.get("key") == b"value"
        assert os.environ["GLOO_SOCKET_IFNAME"] == distributed.loopback_interface()
    finally:
        del store
        process_group.restore_environment()
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # nothing left behind after the run


def test_a_gloo_interface_set_by_the_user_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    store = process_group.loopback_only_store(
        _environment(monkeypatch, "127.0.0.1"), 0, 1, timedelta(seconds=10), "gloo"
    )
    assert store is not None
    process_group.restore_environment()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_a_non_loopback_master_addr_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert process_group.loopback_only_store(_environment(monkeypatch, "192.0.2.1"), 0, 2, None, "gloo") is None
