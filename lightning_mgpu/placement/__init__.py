"""Where each layer runs: splitting a sequential model into pipeline stages.

``partition`` is pure algorithm on plain lists of numbers (no torch import here, so the
planner can run anywhere, e.g. in ``lightning-mgpu plan`` before any device is touched).
"""

from lightning_mgpu.placement.partition import partition

__all__ = ["partition"]
