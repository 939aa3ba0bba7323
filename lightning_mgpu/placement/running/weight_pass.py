"""Zero-bubble's split backward: ``B`` computes a stage's input gradients now, ``W`` its weight gradients later.

An autograd node such as ``AddmmBackward0`` (an ``nn.Linear``) computes both the gradient
of its input and of its weight; the engine computes only the outputs it needs. So:

1. ``B``: ``torch.autograd.grad`` with respect to the stage's cut leaves only
   (``retain_graph=True``). The nodes on a path to a leaf (the *input side*) run and
   compute just their input-side outputs. A pre-hook on every input-side node ``u`` that
   also feeds parameters records the gradient it received.
2. ``W``: for each such ``u``, ``torch.autograd.grad`` from ``u`` (a ``GradientEdge`` with the
   recorded gradient) to the parameters below it: the engine runs ``u`` again for its
   weight-side outputs only, and the nodes between it and the parameters.

This is exact (the same kernels on the same values) when every node below ``u`` on the
weight side is reached from ``u`` alone: then the ``W`` call runs nothing of the input
side again and counts nothing twice. Where the weight side is shared (a parameter used
twice in one stage, a weight transposed once and used by two products), those
parameters' gradients are simply computed in ``B`` (:func:`split_backward` checks it for
every micro-batch). A stage whose graph reaches no cut leaf (the first stage: its inputs
need no gradient) does its whole backward in ``W``, since nobody waits for its ``B``.
The idea and the pre-hook capture follow ``torch.distributed.pipelining``'s
``stage_backward_input``/``stage_backward_weight``, with the private-region rule above
instead of clamping shared intermediates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["DeferredWeights", "Graph", "reached_graph", "split_backward"]

Graph = tuple[set[Node], dict[Node, list[Node]]]
"""The nodes a backward from some roots reaches, and each one's parents among them."""


class DeferredWeights:
    """What a stage's ``W`` pass needs for one micro-batch."""

    def __init__(self) -> None:
        # (node u, the gradient it received in B, indices of the parameters below it)
        self.groups: list[tuple[Node, list[Optional[torch.Tensor]], list[int]]] = []
        self.full: Optional[tuple[list[Any], list[torch.Tensor], list[int]]] = None  # roots, grads, params

    def run(self, params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The deferred parameter gradients, by parameter index."""
        out: dict[int, torch.Tensor] = {}
        if self.full is not None:
            roots, grads, indices = self.full
            self.full = None
            results = torch.autograd.grad(roots, [params[n] for n in indices], grads, allow_unused=True)
            out.update({n: g for n, g in zip(indices, results) if g is not None})
        groups, self.groups = self.groups, []
        for node, received, indices in groups:
            edges = [GradientEdge(node, k) for k, g in enumerate(received) if g is not None]
            if not edges:
                continue
            grads = [g for g in received if g is not None]
            results = torch.autograd.grad(edges, [params[n] for n in indices], grads, allow_unused=True)
            for n, g in zip(indices, results):
                if g is not None:
                    out[n] = g if n not in out else out[n] + g
        return out


def split_backward(
    roots: Sequence[Any],
    grads: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    graph: Optional[Graph] = None,
    accumulated: frozenset[int] = frozenset(),
) -> tuple[tuple[Optional[torch.Tensor], ...], dict[int, torch.Tensor], DeferredWeights]:
    """``B`` of one stage and micro-batch: the leaves' gradients, the parameter gradients that could not be deferred
    (by index), and the :class:`DeferredWeights` for ``W``. ``roots``: tensors or ``GradientEdge`` s, ``grads`` their
    gradients; ``graph``: :func:`reached_graph` of ``roots`` where the caller already has it.

    ``accumulated``: indices of parameters whose node computes their gradient itself and hands autograd None
    (:mod:`~lightning_mgpu.placement.running.linear_grads`; it defers its own part while ``B`` runs). They are asked for in
    the one pass that runs their node exactly once: ``B`` where their node is on no deferred weight side, else the
    ``W`` of the region holding it, so that no node runs both in ``B`` and in ``W``."""
    deferred = DeferredWeights()
    seen, parents = reached_graph(roots) if graph is None else graph
    param_nodes: dict[Node, int] = {}
    self_made: dict[Node, int] = {}
    for n, param in enumerate(params):
        node = get_gradient_edge(param).node
        if node in seen:
            (self_made if n in accumulated else param_nodes)[node] = n
    leaf_nodes = {get_gradient_edge(leaf).node for leaf in leaves if leaf.requires_grad}
    targets = leaf_nodes & seen
    if not targets:  # nothing to send upstream: the whole backward waits for W
        deferred.full = (list(roots), list(grads), sorted([*param_nodes.values(), *self_made.values()]))
        return (None,) * len(leaves), {}, deferred

    input_side = _closure(targets, lambda node: parents.get(node, []))
    handles = []
    deferred_params: set[int] = set()
    for node in input_side:
        starts = [child for child in _children(node) if child not in input_side]
        if not starts:
            continue
        region = _closure(starts, _children)
        if not all(parent is node or parent in region for member in region for parent in parents.get(member, [])):
            continue  # shared weight side: its parameters' gradients are computed in B
        indices = sorted(param_nodes[member] for member in region if member in param_nodes)
        if not indices:
            continue
        indices = sorted([*indices, *(self_made[member] for member in region if member in self_made)])
        received: list[Optional[torch.Tensor]] = []
        deferred.groups.append((node, received, indices))
        deferred_params.update(indices)
        handles.append(node.register_prehook(_recorder(received)))
    now = sorted(n for n in [*param_nodes.values(), *self_made.values()] if n not in deferred_params)
    try:
        results = torch.autograd.grad(
            list(roots),
            list(leaves) + [params[n] for n in now],
            list(grads),
            retain_graph=bool(deferred.groups),
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    leaf_grads = tuple(results[: len(leaves)])
    param_grads = {n: g for n, g in zip(now, results[len(leaves) :]) if g is not None}
    return leaf_grads, param_grads, deferred


def reached_graph(roots: Sequence[Any]) -> Graph:
    """The autograd nodes reachable from ``roots`` (tensors or ``GradientEdge`` s) and their parents there."""
    root_nodes = [root.node if isinstance(root, GradientEdge) else root.grad_fn for root in roots]
    parents: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    stack = [node for node in root_nodes if node is not None]
    seen.update(stack)
    while stack:
        node = stack.pop()
        for child in _children(node):
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen, parents


def _closure(starts: Iterable[Node], neighbours: Callable[[Node], Iterable[Node]]) -> set[Node]:
    """``starts`` and every node reached from them through ``neighbours``."""
    region = set(starts)
    stack = list(starts)
    while stack:
        for other in neighbours(stack.pop()):
            if other not in region:
                region.add(other)
                stack.append(other)
    return region


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _recorder(received: list[Optional[torch.Tensor]]) -> Any:
    def hook(grad_outputs: tuple[Optional[torch.Tensor], ...]) -> None:
        received[:] = list(grad_outputs)

    return hook
