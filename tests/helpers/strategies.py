"""What the in-process and the multi-process tests of a strategy share (tests/unit/strategies/, tests/dist/strategies/).

A fixture here is shared by assigning it in the test module (``clean_process = strategies.clean_process``):
pytest finds fixtures by the module's names.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from tests.conftest import destroy_default_group


# ----------------------------------------------------------------------------- test_lightning_parity.py
@pytest.fixture
def clean_process() -> Iterator[dict[str, str]]:
    """The environment before the test (yielded); afterwards no process group and the same environment.

    Stricter than tests/conftest.py's ``clean_process``, which it overrides where it is assigned: the launcher's
    variables are removed before the test too."""
    environ = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GLOO_SOCKET_IFNAME"):
        os.environ.pop(key, None)
    yield dict(os.environ)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        destroy_default_group()  # freed on the main thread: tests/conftest.py
    os.environ.clear()
    os.environ.update(environ)
