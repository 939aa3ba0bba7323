"""``reentrant-checkpoint``: reentrant activation checkpointing under DDP with ``find_unused_parameters=True``.

DDP's first backward fails on it, before any regular check: the ranks meet before that backward
on this finding alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_mgpu._compat.torch import is_reentrant_checkpoint_node
from lightning_mgpu.callbacks.doctor.findings import Finding
from lightning_mgpu.callbacks.doctor.probes import nested
from lightning_mgpu.callbacks.doctor.rule import Rule, Watch

RULE = Rule(
    "reentrant-checkpoint",
    catches="reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True, "
    "checkpoint_sequential, a Hugging Face model's gradient checkpointing) under DDP with "
    "find_unused_parameters=True: the first backward fails ('Expected to mark a variable ready only once')",
    detection="before the first backward: the loss's autograd graph holds a reentrant checkpoint's node, "
    "while DDP has find_unused_parameters=True and no static graph",
    cost="one walk over the first loss's autograd graph (find_unused_parameters=True only), and one small exchange",
    fix="TunedDDPStrategy(static_graph=True) (stock: DDPStrategy(static_graph=True)) if the graph is the same at "
    "every step (DDP then finds unused parameters itself: find_unused_parameters is not needed); or "
    "checkpoint(..., use_reentrant=False) (Hugging Face: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})); or "
    "find_unused_parameters=False if every parameter gets a gradient",
    severity="fatal",
)


def reentrant_checkpoints(output: Any) -> int:
    """Reentrant checkpoint regions (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, and what
    calls it: ``checkpoint_sequential``, Hugging Face's gradient checkpointing) in the autograd graph that
    produced ``output`` (a tensor, or tensors nested in lists/tuples/dicts).

    The graph itself, not the call: it finds the regions however ``checkpoint`` was imported or wrapped.
    A region whose inputs need no gradient is not in the graph (it gives its parameters no gradient either).
    """
    roots = [t.grad_fn for t in nested(output, torch.Tensor) if t.grad_fn is not None]
    seen: dict[int, Any] = {}  # the nodes themselves kept: a freed node's id may come back for another
    found = 0
    while roots:
        node = roots.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if is_reentrant_checkpoint_node(node):
            found += 1
        roots.extend(child for child, _ in node.next_functions if child is not None)
    return found


def reentrant_checkpoint_finding(regions: int) -> Finding:
    return RULE.finding(
        seen=f"the first loss's autograd graph holds {regions} reentrant checkpoint region(s) "
        "(torch.utils.checkpoint with use_reentrant=True), and DDP has find_unused_parameters=True without a "
        "static graph",
        why="a reentrant checkpoint runs its region without a graph and recomputes it during backward: DDP's search "
        "for unused parameters after the forward misses the region's parameters and marks them ready, then their "
        "gradients arrive in the backward and DDP stops with an error at the first backward",
    )


class ReentrantCheckpoint(Watch):
    rules = (RULE,)

    def before_first_backward(self, loss: torch.Tensor) -> Optional[list[Finding]]:
        ddp = self.doctor.parameter_watch.ddp
        if ddp is None or not ddp.find_unused or ddp.static_graph or not self.doctor.enabled(RULE.id):
            return None  # (the same on every rank: DDP's options and this callback's)
        regions = reentrant_checkpoints(loss)
        return [reentrant_checkpoint_finding(regions)] if regions else []
