"""A step's parameter gradients in the pipeline: each stage's backward of a micro-batch, the stages' sums, and
their one accumulation into ``.grad``, scaled by the gradient the step's combined loss received.

* ``B`` (:meth:`StageGradients.backward`): ``torch.autograd.grad`` of what the stage's outputs
  received (the loss on the last stage, scaled by the micro-batch's share; else the
  gradients the next stage sent for the tensors it got at its split point) with respect to
  the stage's cut leaves and the parameters. With zero-bubble, ``B`` computes only the cut
  leaves' gradients and ``W`` (:meth:`StageGradients.weight`) the parameters'
  (:mod:`~lightning_mgpu.placement.running.weight_pass`). Each leaf's gradient goes back to
  the stage that made its tensor.
* Each stage sums its parameters' gradients over the micro-batches (plain ``nn.Linear``
  layers add theirs in place: :mod:`~lightning_mgpu.placement.running.linear_grads`); a
  parameter used by several stages (tied embeddings) gets every stage's part.
* Nothing reaches ``.grad`` until :meth:`StageGradients.accumulate`, which does it with one
  ``torch.autograd.backward`` over the parameters, so each gradient accumulator (and DDP's
  hook on it) fires exactly once per step. With the loss inside the pipeline, the step's
  result is the micro-batch losses' weighted sum as a leaf of its own
  (:func:`combine_results`): the gradient ``loss.backward()`` leaves on it (1, or a loss
  scale, or a pre-division) scales the accumulation.

A tensor computed before a split point and used after it without being passed to it (a skip
connection around the split point) is refused at the first backward that meets it, before
any parameter changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from lightning_mgpu.placement.running.handover import CopyStreams, MicroRun, PipelineModelError
from lightning_mgpu.placement.running.linear_grads import LinearWeightGrads
from lightning_mgpu.placement.running.microbatch import map_tensors
from lightning_mgpu.placement.running.weight_pass import DeferredWeights, reached_graph, split_backward

__all__ = ["StageGradients", "combine_results", "loss_of"]


class StageGradients:
    """The trainable parameters of ``root``, each stage's running sums of their gradients, and the stages' backward.

    ``exclude``: ids of parameters the ``nn.Linear`` fast path must leave to autograd (those used through a copy on
    another stage)."""

    def __init__(
        self,
        root: nn.Module,
        split_points: Sequence[str],
        devices: Sequence[torch.device],
        copies: CopyStreams,
        *,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        self.split_points = list(split_points)
        self.devices = list(devices)
        self.copies = copies
        self.params: list[nn.Parameter] = [p for p in root.parameters() if p.requires_grad]
        self.sums: list[dict[int, torch.Tensor]] = [{} for _ in self.devices]
        self.linear_grads = LinearWeightGrads(root, self.params, self.sums, exclude=exclude)

    def clear(self) -> None:
        """Forget the sums (a new step, or one that was skipped)."""
        for sums in self.sums:
            sums.clear()

    # ------------------------------------------------------------------ B and W
    def _roots(
        self, j: int, micro: MicroRun, message: Any
    ) -> tuple[list[Any], list[torch.Tensor], dict[Any, torch.Tensor]]:
        """The stage's outputs that received a gradient, those gradients, and what passes on to earlier stages."""
        roots: list[Any] = []
        grads: list[torch.Tensor] = []
        onward: dict[Any, torch.Tensor] = {}
        device = self.devices[j]
        if j == len(self.devices) - 1:
            if micro.loss is not None and micro.loss.requires_grad:  # the loss inside: its share of the batch
                roots.append(micro.loss)
                grads.append(torch.full_like(micro.loss, micro.weight))
            elif isinstance(message, torch.Tensor) and micro.result.requires_grad:  # the output's, from the caller
                roots.append(micro.result)
                grads.append(message)
            message = None
        for key, grad in (message or {}).items():
            stage, edge = micro.sources[key]
            if stage == j:
                roots.append(edge)
                grads.append(self.copies.move(grad, device))
            else:
                onward[key] = grad
        return roots, grads, onward

    def backward(self, j: int, micro: MicroRun, message: Any, split_weight: bool) -> dict[Any, torch.Tensor]:
        """Stage ``j``'s ``B`` of ``micro``: returns the gradients for the earlier stages, by the cut they belong to."""
        roots, grads, onward = self._roots(j, micro, message)
        own = micro.cuts[j]
        earlier = [cut for stage in range(j) for cut in micro.cuts[stage]]
        leaves = [cut.leaf for cut in own] + [cut.leaf for cut in earlier]
        if not roots:
            results: tuple[Optional[torch.Tensor], ...] = (None,) * len(leaves)
            param_grads: dict[int, torch.Tensor] = {}
        elif split_weight:
            graph = reached_graph(roots)
            _claim(j, graph[0], self.split_points)
            micro.splitting = j
            try:
                results, param_grads, deferred = split_backward(
                    roots, grads, leaves, self.params, graph=graph, accumulated=self.linear_grads.accumulated
                )
            finally:
                micro.splitting = -1
            micro.deferred[j] = deferred
        else:
            try:
                out = torch.autograd.grad(roots, [*leaves, *self.params], grads, allow_unused=True)
            except RuntimeError as exc:
                raise _explain(exc, self.split_points, j) from exc
            results = out[: len(leaves)]
            param_grads = {n: g for n, g in enumerate(out[len(leaves) :]) if g is not None}
        for cut, grad in zip(earlier, results[len(own) :]):
            if grad is not None:
                raise PipelineModelError(
                    f"a tensor that entered stage {micro.leaf_stage[id(cut.leaf)]} at split point "
                    f"{self.split_points[micro.leaf_stage[id(cut.leaf)] - 1]!r} is used again in stage {j} without being "
                    f"passed to split point {self.split_points[j - 1]!r} (e.g. a skip connection around it): "
                    "pass it as an argument of that split point, or choose split points that no such connection crosses"
                )
        sent = {id(g) for g in results if g is not None}
        for cut, grad in zip(own, results[: len(own)]):
            if grad is None:
                continue
            previous = onward.get(cut.key)
            onward[cut.key] = grad if previous is None else previous + grad.to(previous.device)
        self._add(j, param_grads, sent | {id(g) for g in grads})
        # Free what this stage's graph no longer needs: its leaves, its sources, the loss's graph.
        micro.cuts[j] = []
        micro.sources = {key: value for key, value in micro.sources.items() if value[0] != j}
        if j == len(self.devices) - 1:
            micro.result, micro.loss = map_tensors(micro.result, torch.Tensor.detach), None
        return onward

    def weight(self, j: int, micro: MicroRun) -> None:
        """Stage ``j``'s ``W`` of ``micro`` (zero-bubble): the parameter gradients its ``B`` left."""
        deferred: Optional[DeferredWeights] = micro.deferred.pop(j, None)
        if deferred is not None:
            try:
                self._add(j, deferred.run(self.params), set())
            except RuntimeError as exc:
                raise _explain(exc, self.split_points, j) from exc
        self.linear_grads.run_deferred(micro, j)

    def _add(self, j: int, param_grads: dict[int, torch.Tensor], foreign: set[int]) -> None:
        sums = self.sums[j]
        for n, grad in param_grads.items():
            held = sums.get(n)
            if held is None:
                # never accumulate in place into a tensor that was also sent upstream or handed to us
                sums[n] = grad.clone() if id(grad) in foreign else grad
            else:
                held.add_(grad)

    # ------------------------------------------------------------------ .grad
    def accumulate(self, scale: Optional[torch.Tensor] = None) -> bool:
        """Accumulate the sums into ``.grad`` (times ``scale``, the gradient a combined loss received: 1 for a plain
        ``loss.backward()``, a loss scale or a pre-division shows up here); each parameter's accumulator fires once.
        Returns False when there was nothing to accumulate."""
        totals: dict[int, torch.Tensor] = {}
        for sums in self.sums:
            for n, grad in sums.items():
                grad = self.copies.move(grad, self.params[n].device)
                totals[n] = grad if n not in totals else totals[n].add_(grad)
        self.clear()
        if not totals:
            return False
        ordered = sorted(totals)
        grads = [totals[n] for n in ordered]
        if scale is not None and not bool((scale == 1).all()):
            grads = [g.mul_(scale.to(g.device)) for g in grads]
        torch.autograd.backward([self.params[n] for n in ordered], grads)
        return True


def combine_results(results: list[Any], weights: list[float], *, trains: bool) -> tuple[Any, Optional[torch.Tensor]]:
    """The micro-batches' results of a step as one, and the leaf whose gradient scales :meth:`StageGradients.accumulate`
    (None where nothing trains). The loss (a tensor, or a dict's ``"loss"``): a fresh leaf holding the weighted sum of
    the micro-batch losses; other tensors of a dict: the same weighted sum, detached; anything else: the last value."""
    first = results[0]
    if isinstance(first, torch.Tensor) or first is None:
        return _combined_loss(results, weights, trains)
    if isinstance(first, Mapping):
        out: dict[str, Any] = {}
        leaf: Optional[torch.Tensor] = None
        for key in first:
            values = [result[key] for result in results]
            if key == "loss":
                out[key], leaf = _combined_loss(values, weights, trains)
            elif all(isinstance(value, torch.Tensor) and value.shape == values[0].shape for value in values):
                out[key] = sum(w * value.detach() for w, value in zip(weights, values))
            else:
                out[key] = values[-1]
        return out, leaf
    raise PipelineModelError(
        f"the step returned {type(first).__name__}: with the pipeline it must return the loss (a tensor) or a "
        "dict with a 'loss' entry"
    )


def _combined_loss(losses: list[Any], weights: list[float], trains: bool) -> tuple[Any, Optional[torch.Tensor]]:
    if any(loss is None for loss in losses):
        if all(loss is None for loss in losses):
            return None, None
        raise PipelineModelError("the step returned None for some micro-batches only: return the loss for every one")
    device = losses[0].device
    total = sum(w * loss.detach().to(device) for w, loss in zip(weights, losses))
    leaf = total.detach().requires_grad_(trains)
    return leaf, leaf if leaf.requires_grad else None


def loss_of(result: Any) -> Optional[torch.Tensor]:
    """The loss in a step's result: the result itself (a tensor), or its ``"loss"`` entry."""
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
        return result["loss"]  # type: ignore[no-any-return]
    return None


def _explain(exc: RuntimeError, split_points: Sequence[str], stage: int) -> BaseException:
    text = str(exc)
    if "backward through the graph a second time" in text or "has been freed" in text:
        return _crossing(split_points, stage, "another stage already ran")
    return exc


# The key of an autograd node's metadata that names the stage whose split backward reached it.
_CLAIM = "lightning_mgpu.pipeline_stage"


def _claim(stage: int, nodes: set[Any], split_points: Sequence[str]) -> None:
    """Mark the autograd nodes of ``stage``'s backward; refuse a node a later stage's backward reached.

    With a split backward (``B`` keeps the graph for ``W``), the freed-buffer error that gives away a tensor crossing
    a split point unpassed comes only if the two stages' backward passes happen not to run the shared node at the
    same moment; this finds it every time. Leaf nodes (a parameter's accumulator, used by every stage) are not claimed.

    The mark lives in the node's own ``metadata`` and dies with it. A table of nodes held by the micro-batch until
    stage 0's ``B`` kept every node of a stage's retained graph, and with it the saved tensors its ``W`` does not
    free, for as long as the earlier stages lagged: past the schedule's memory bound whenever they did."""
    for node in nodes:
        if not node.next_functions:
            continue
        other = node.metadata.setdefault(_CLAIM, stage)
        if other != stage:
            raise _crossing(split_points, stage, f"stage {other}'s backward also reached")


def _crossing(split_points: Sequence[str], stage: int, what: str) -> PipelineModelError:
    return PipelineModelError(
        f"stage {stage}'s backward reached a part of the graph that {what}: a tensor computed before one of the "
        f"split points {list(split_points)} is used after it without being passed to it (e.g. a skip connection "
        "around a split point). Pass it as an argument of the split point, or choose split points that no such "
        "connection crosses."
    )
