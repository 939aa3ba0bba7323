"""The lab's bandwidth probe: a raw TCP transfer between two nodes (run inside them by ``Lab.measure_link``).

    ip netns exec NODE1 python -m bench.netlab_probe --receive 127.78.0.2 29001 125000000
    ip netns exec NODE0 python -m bench.netlab_probe --send 127.78.0.2 29001 125000000

The receiver prints ``{"bytes": ..., "seconds": ...}`` timed from the first chunk to the last
(connection set-up is no part of a link's rate). No torch import: it starts in a blink.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from typing import Any, Optional, Sequence


def _receive(host: str, port: int, total: int) -> dict[str, Any]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(1)
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            buffer = bytearray(1 << 20)
            received, first, start = 0, 0, 0.0
            while received < total:
                count = connection.recv_into(buffer)
                if count == 0:
                    break
                if received == 0:  # time from the first chunk: connection set-up is no part of the rate
                    start, first = time.perf_counter(), count
                received += count
            elapsed = time.perf_counter() - start
    return {"bytes": received - first, "seconds": elapsed}


def _send(host: str, port: int, total: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with connection:
        chunk = b"\0" * (1 << 20)
        sent = 0
        while sent < total:
            sent += connection.send(chunk[: min(len(chunk), total - sent)])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="netlab's bandwidth probe (run inside a node by Lab.measure_link)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--receive", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    group.add_argument("--send", nargs=3, metavar=("HOST", "PORT", "BYTES"))
    args = parser.parse_args(argv)
    if args.receive:
        host, port, total = args.receive
        print(json.dumps(_receive(host, int(port), int(total))))
    else:
        host, port, total = args.send
        _send(host, int(port), int(total))


if __name__ == "__main__":
    main()
