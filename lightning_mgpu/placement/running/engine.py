"""Pipelining any ``nn.Module`` as it is: the user's own code runs per micro-batch, cut into stages where named submodules are called.

:class:`StagedStep` takes a root module, the qualified names of the submodules where a new
stage begins (``split_points``, torch's convention) and a schedule, and runs a function
(the LightningModule's ``training_step``: forward **and** loss) once per micro-batch:

* **Forward.** Each micro-batch runs the function in a thread of its own (its Python call
  stack cannot move between threads); a forward pre-hook on every split point stops it
  there until the stage that begins at that point gives it its turn. Stage ``j``'s
  worker thread is the stage's clock: it runs its schedule's actions in order, and for a
  ``F`` action lets micro-batch ``i`` run from split point ``j`` to split point ``j + 1``
  (or to the function's end). So a stage never runs two things at once, and the user's
  code, however it is written, runs unchanged.
* **The cut.** At a split point, every tensor argument that requires grad is replaced by
  a detached copy of itself, a new leaf of the next stage's graph (moved to that stage's
  device); the original (its gradient edge) is remembered. So the stages' autograd graphs
  are apart and each stage's backward runs in its own worker thread. A tensor passed to
  several split points (e.g. encoder states given to every block) is cut each time and
  its gradients go back to the stage that made it.
* **Loss inside the pipeline.** The function's result on the last stage is the
  micro-batch's loss, so the last stage can start that micro-batch's backward at once
  (what 1F1B and zero-bubble need). Its gradient is ``n_i / N`` (the micro-batch's share
  of the batch): the step's gradient is the one of the sample-weighted mean of the
  micro-batch losses, which is the full batch's loss when the loss is a mean over samples
  (the usual ``reduction="mean"``; pass ``loss_reduction="sum"`` for sums).
* **Backward.** ``B`` runs ``torch.autograd.grad`` of the stage's outputs with respect to
  its cut leaves and the parameters; with ``zero_bubble``, ``B`` computes only the cut
  leaves' gradients and ``W`` the parameters' (:mod:`~lightning_mgpu.placement.running.weight_pass`).
  Each stage sums its parameters' gradients over the micro-batches; a parameter used by
  several stages (tied embeddings) gets the sum of every stage's part (on stages of different
  devices through a differentiable copy: :mod:`~lightning_mgpu.placement.running.shared_params`). Nothing is
  accumulated into ``.grad`` until :meth:`StagedStep.accumulate`, which does it with one
  ``torch.autograd.backward`` per parameter set, so each gradient accumulator (and DDP's
  hook on it) fires exactly once per step, after DDP prepared its reducer.

Supported: any Python between the split points, tuples/dicts of tensors as arguments,
non-tensor arguments, in-place layers at a split point (their input is copied first),
BatchNorm (per micro-batch statistics, as in every micro-batched pipeline), dropout.
Refused with a clear error: a split point that is not called, called twice or out of
order in one step; a tensor computed before a split point used after it without being
passed to it (e.g. a skip connection around the split point): the step fails at its first
backward, before any parameter changed (see :class:`StagedStepError`).

Around it: :mod:`~lightning_mgpu.placement.running.handover` (a micro-batch's thread and its turns),
:func:`~lightning_mgpu.placement.running.microbatch.split_batch` (the batch cut into micro-batches),
:mod:`~lightning_mgpu.placement.staged_fit` (what a Lightning fit adds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from lightning_mgpu._checks import check_int
from lightning_mgpu.placement.running.handover import (
    Aborted,
    Cut,
    MicroRun,
    StagedStepError,
    current_microbatch,
    current_run,
    running,
)
from lightning_mgpu.placement.running.linear_grads import LinearWeightGrads
from lightning_mgpu.placement.running.microbatch import map_tensors, split_batch
from lightning_mgpu.placement.running.shared_params import SharedParameterCopies
from lightning_mgpu.placement.planning.schedule import BACKWARD, FORWARD, SCHEDULES, WEIGHT, Action, make_schedule
from lightning_mgpu.placement.running.weight_pass import DeferredWeights, reached_graph, split_backward
from lightning_mgpu.placement.running.worker import Receive, Send, StageWorkers, stage_context, thread_modes

__all__ = ["LOSS_REDUCTIONS", "StagedStep", "StagedStepError", "current_microbatch", "split_batch"]

LOSS_REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------- the engine
class StagedStep:
    """Run a function of ``root`` micro-batch by micro-batch over the stages that ``split_points`` cut it into.

    ``devices[j]``: stage ``j``'s device (``len(split_points) + 1`` of them). Modules are not
    moved here (the strategy places them). ``schedule``: a name of
    :data:`~lightning_mgpu.placement.planning.schedule.SCHEDULES`. A parameter used by modules of stages on
    different devices (tied embeddings) is used through a differentiable copy on the using stage's
    device (:mod:`~lightning_mgpu.placement.running.shared_params`); ``copy_shared=True`` copies it even where
    the devices are the same (how the tests run that path on CPU stages).
    """

    def __init__(
        self,
        root: nn.Module,
        split_points: Sequence[str],
        devices: Sequence[Union[str, torch.device]],
        *,
        schedule: str = "gpipe",
        microbatches: int = 1,
        threads_per_stage: Optional[int] = None,
        loss_reduction: str = "mean",
        copy_shared: bool = False,
    ) -> None:
        self.split_points = list(split_points)
        self.devices = [torch.device(device) for device in devices]
        if len(self.devices) != len(self.split_points) + 1:
            raise ValueError(
                f"{len(self.split_points)} split point(s) make {len(self.split_points) + 1} stages, but "
                f"{len(self.devices)} device(s) were given: pass one device per stage"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        self.schedule_name = schedule
        self.microbatches = check_int("microbatches", microbatches)
        self.loss_reduction = loss_reduction
        self.root = root
        self.modules = [_submodule(root, name) for name in self.split_points]
        cpu_stages = sum(device.type == "cpu" for device in self.devices)
        if threads_per_stage is None:
            threads_per_stage = max(1, torch.get_num_threads() // max(1, cpu_stages))
        self.threads_per_stage = check_int("threads_per_stage", threads_per_stage)
        self.params: list[nn.Parameter] = [p for p in root.parameters() if p.requires_grad]
        self._param_index = {id(p): n for n, p in enumerate(self.params)}
        self._sums: list[dict[int, torch.Tensor]] = [{} for _ in self.devices]
        self._in_place = [_starts_in_place(module) for module in self.modules]
        self._workers = StageWorkers(self.devices, lambda value, device: value)
        self._threads: Optional[ThreadPoolExecutor] = None
        self._thread_count = 0
        self._result_leaf: Optional[torch.Tensor] = None
        self._handles = [
            module.register_forward_pre_hook(self._hook(n + 1), with_kwargs=True)
            for n, module in enumerate(self.modules)
        ]
        # after the split-point hooks: a split point that also uses a shared parameter gets its copy once its turn came
        self._shared = SharedParameterCopies(root, self.split_points, self.devices, always=copy_shared)
        copied = {id(getattr(root.get_submodule(module), name)) for module, name, _ in self._shared.uses}
        self.linear_grads = LinearWeightGrads(root, self.params, self._sums, exclude=frozenset(copied))

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    # ------------------------------------------------------------------ a step
    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run once per micro-batch (the tensors of ``args``/``kwargs`` cut along
        their first dimension) through the stages; returns the combined result (see :meth:`combine`).
        Parameter gradients are summed, not accumulated: call :meth:`accumulate` after the loss's backward."""
        pieces, sizes = split_batch((args, kwargs), self.microbatches)
        total = sum(sizes)
        k, m = self.num_stages, len(pieces)
        weights = [size / total if self.loss_reduction == "mean" else 1.0 for size in sizes]
        micros = [
            MicroRun(index=i, weight=weights[i], args=tuple(piece[0]), kwargs=dict(piece[1]), num_stages=k, owner=self)
            for i, piece in enumerate(pieces)
        ]
        for sums in self._sums:
            sums.clear()
        self._result_leaf = None
        schedule = make_schedule(self.schedule_name, k, m)
        modes = thread_modes()
        threads = self._get_threads(m)
        running: list[Optional[Future[None]]] = [None] * m
        split_weight = any(action.kind == WEIGHT for actions in schedule for action in actions)

        def start(micro: MicroRun) -> None:
            running[micro.index] = threads.submit(self._run_micro, micro, fn, modes)

        def program(j: int, actions: list[Action], receive: Receive, send: Send) -> None:
            with stage_context(self.devices[j], self.threads_per_stage, modes):
                for action in actions:
                    micro = micros[action.microbatch]
                    if action.kind == FORWARD:
                        receive(action)
                        if j == 0:
                            start(micro)
                        micro.grant(j)
                        micro.wait_reached(j + 1)
                        send(action, None)
                    elif action.kind == BACKWARD:
                        message = receive(action)
                        send(action, self._backward(j, micro, message, split_weight))
                    else:
                        self._weight(j, micro)

        try:
            self._workers.run(schedule, program, list(range(m)), [None] * m)
        finally:
            for micro in micros:
                micro.abort()  # threads still waiting for a turn (after a failure) unwind
            for future in running:
                if future is not None:
                    future.exception()  # wait: no user code keeps running after the step
        return self.combine([micro.result for micro in micros], weights, trains=any(micro.trains for micro in micros))

    def _run_micro(self, micro: MicroRun, fn: Callable[..., Any], modes: dict[str, Any]) -> None:
        try:
            with running(micro), stage_context(self.devices[0], self.threads_per_stage, modes):
                micro.arrive(0)
                result = fn(*micro.args, **micro.kwargs)
            if micro.reached != self.num_stages - 1:
                missing = self.split_points[micro.reached]
                raise StagedStepError(
                    f"split point {missing!r} was not called in this step (micro-batch {micro.index} ended in stage "
                    f"{micro.reached}): every split point must be called once per step, in order. Check the name, "
                    "or whether the model skips that submodule for this input."
                )
            micro.result = result
            micro.loss = _loss_of(result)
            micro.trains = micro.loss is not None and micro.loss.requires_grad
            micro.arrive(self.num_stages)
        except Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the stage that waits for this micro-batch
            micro.fail(exc)

    def _hook(self, boundary: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            micro = current_run()
            device = self.devices[boundary]
            if micro is None:  # not a staged step (e.g. validation): move the inputs, nothing else
                return map_tensors((args, kwargs), lambda t: t.to(device) if t.device != device else t)
            if micro.owner is not self:
                return None
            if micro.reached != boundary - 1 or micro.granted != boundary - 1:
                raise StagedStepError(
                    f"split point {self.split_points[boundary - 1]!r} was called while stage {micro.reached} was "
                    f"running micro-batch {micro.index}: every split point must be called exactly once per step, in "
                    "the order the split points are given. Is a split-point submodule used twice (shared blocks)?"
                )
            cut = self._cut(micro, boundary, device)
            new = map_tensors((args, kwargs), cut)
            micro.arrive(boundary)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return new

        return hook

    def _cut(self, micro: MicroRun, boundary: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        clone = self._in_place[boundary - 1]
        made: dict[tuple[int, int], torch.Tensor] = {}

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.requires_grad or not (tensor.is_floating_point() or tensor.is_complex()):
                return tensor.to(device) if tensor.device != device else tensor
            if tensor.grad_fn is None and id(tensor) not in micro.leaf_stage:
                return tensor  # a parameter (or another leaf of the user's) passed along: used where it is
            edge = get_gradient_edge(tensor)
            key = (id(edge.node), edge.output_nr)
            if key in made:
                return made[key]
            known = micro.sources.get(key)
            if known is None:
                stage = micro.leaf_stage.get(id(tensor), boundary - 1)
                micro.sources[key] = (stage, edge)
            else:
                stage = known[0]
            leaf = tensor.detach()
            leaf = (leaf.to(device) if leaf.device != device else leaf).requires_grad_()
            micro.cuts[boundary].append(Cut(key=key, source_stage=stage, leaf=leaf))
            micro.leaf_stage[id(leaf)] = boundary
            made[key] = leaf.clone() if clone else leaf
            return made[key]

        return cut

    # ------------------------------------------------------------------ backward
    def _roots(
        self, j: int, micro: MicroRun, message: Optional[dict[Any, torch.Tensor]]
    ) -> tuple[list[Any], list[torch.Tensor], dict[Any, torch.Tensor]]:
        """The stage's outputs that received a gradient, those gradients, and what passes on to earlier stages."""
        roots: list[Any] = []
        grads: list[torch.Tensor] = []
        onward: dict[Any, torch.Tensor] = {}
        device = self.devices[j]
        if j == self.num_stages - 1:
            message = None  # the last stage's backward starts from the loss
            if micro.loss is not None and micro.loss.requires_grad:
                roots.append(micro.loss)
                grads.append(torch.full_like(micro.loss, micro.weight))
        for key, grad in (message or {}).items():
            stage, edge = micro.sources[key]
            if stage == j:
                roots.append(edge)
                grads.append(grad.to(device) if grad.device != device else grad)
            else:
                onward[key] = grad
        return roots, grads, onward

    def _backward(self, j: int, micro: MicroRun, message: Any, split_weight: bool) -> dict[Any, torch.Tensor]:
        roots, grads, onward = self._roots(j, micro, message)
        own = micro.cuts[j]
        earlier = [cut for stage in range(j) for cut in micro.cuts[stage]]
        leaves = [cut.leaf for cut in own] + [cut.leaf for cut in earlier]
        if not roots:
            results: tuple[Optional[torch.Tensor], ...] = (None,) * len(leaves)
            param_grads: dict[int, torch.Tensor] = {}
        elif split_weight:
            graph = reached_graph(roots)
            _claim(micro, j, graph[0], self.split_points)
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
                raise StagedStepError(
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
        if j == self.num_stages - 1:
            micro.result, micro.loss = map_tensors(micro.result, torch.Tensor.detach), None
        if j == 0:
            # Every stage's B has run: the claims served their purpose. Kept, they would hold every node of the
            # retained graphs (zero-bubble's B keeps the graph for W) and with them the saved activations of
            # all the step's micro-batches until the step ends, far past the schedule's bound.
            micro.claimed.clear()
        return onward

    def _weight(self, j: int, micro: MicroRun) -> None:
        deferred: Optional[DeferredWeights] = micro.deferred.pop(j, None)
        if deferred is not None:
            try:
                self._add(j, deferred.run(self.params), set())
            except RuntimeError as exc:
                raise _explain(exc, self.split_points, j) from exc
        self.linear_grads.run_deferred(micro, j)

    def _add(self, j: int, param_grads: dict[int, torch.Tensor], foreign: set[int]) -> None:
        sums = self._sums[j]
        for n, grad in param_grads.items():
            held = sums.get(n)
            if held is None:
                # never accumulate in place into a tensor that was also sent upstream or handed to us
                sums[n] = grad.clone() if id(grad) in foreign else grad
            else:
                held.add_(grad)

    # ------------------------------------------------------------------ results
    def combine(self, results: list[Any], weights: list[float], *, trains: bool) -> Any:
        """The micro-batches' results as one: the loss (a tensor, or a dict's ``"loss"``) as a fresh leaf holding
        the weighted sum of the micro-batch losses (its gradient scales the step's gradients, see
        :meth:`accumulate`); other tensors of a dict: the same weighted sum, detached; anything else: the last value."""
        first = results[0]
        if isinstance(first, torch.Tensor) or first is None:
            return self._combined_loss(results, weights, trains)
        if isinstance(first, Mapping):
            out: dict[str, Any] = {}
            for key in first:
                values = [result[key] for result in results]
                if key == "loss":
                    out[key] = self._combined_loss(values, weights, trains)
                elif all(isinstance(value, torch.Tensor) and value.shape == values[0].shape for value in values):
                    out[key] = sum(w * value.detach() for w, value in zip(weights, values))
                else:
                    out[key] = values[-1]
            return out
        raise StagedStepError(
            f"the step returned {type(first).__name__}: with the pipeline it must return the loss (a tensor) or a "
            "dict with a 'loss' entry"
        )

    def _combined_loss(self, losses: list[Any], weights: list[float], trains: bool) -> Any:
        if any(loss is None for loss in losses):
            if all(loss is None for loss in losses):
                return None
            raise StagedStepError("the step returned None for some micro-batches only: return the loss for every one")
        device = losses[0].device
        total = sum(w * loss.detach().to(device) for w, loss in zip(weights, losses))
        leaf = total.detach().requires_grad_(trains)
        self._result_leaf = leaf if leaf.requires_grad else None
        return leaf

    def accumulate(self) -> bool:
        """Accumulate the step's summed gradients into ``.grad``, scaled by the gradient the combined loss
        received (1 for a plain ``loss.backward()``; a loss scale or a pre-division shows up here); each
        parameter's accumulator fires once. Returns False when there was nothing to accumulate."""
        leaf, self._result_leaf = self._result_leaf, None
        if leaf is None or leaf.grad is None:
            for sums in self._sums:
                sums.clear()
            return False
        scale = leaf.grad
        totals: dict[int, torch.Tensor] = {}
        for sums in self._sums:
            for n, grad in sums.items():
                device = self.params[n].device
                grad = grad.to(device) if grad.device != device else grad
                totals[n] = grad if n not in totals else totals[n].add_(grad)
            sums.clear()
        if not totals:
            return False
        ordered = sorted(totals)
        grads = [totals[n] for n in ordered]
        if not bool((scale == 1).all()):
            grads = [g.mul_(scale.to(g.device)) for g in grads]
        torch.autograd.backward([self.params[n] for n in ordered], grads)
        return True

    def discard(self) -> None:
        """Forget a step's summed gradients (e.g. a skipped step)."""
        self._result_leaf = None
        for sums in self._sums:
            sums.clear()

    # ------------------------------------------------------------------ threads
    def _get_threads(self, count: int) -> ThreadPoolExecutor:
        if self._threads is None or self._thread_count < count:
            if self._threads is not None:
                self._threads.shutdown(wait=True)
            self._threads = ThreadPoolExecutor(max_workers=count, thread_name_prefix="lightning_mgpu-microbatch")
            self._thread_count = count
        return self._threads

    def close(self) -> None:
        """Remove the split-point hooks and stop the threads."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._shared.close()
        self.linear_grads.close()
        self._workers.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            self._threads = None


def _submodule(root: nn.Module, name: str) -> nn.Module:
    try:
        return root.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"split point {name!r} is not a submodule of {type(root).__name__}: give qualified names as "
            "root.named_modules() lists them (e.g. 'model.transformer.h.2')"
        ) from None


def _starts_in_place(module: nn.Module) -> bool:
    """Whether the first leaf module a split point runs is an in-place one (``nn.ReLU(inplace=True)``)."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


def _loss_of(result: Any) -> Optional[torch.Tensor]:
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


def _claim(micro: MicroRun, stage: int, nodes: set[Any], split_points: Sequence[str]) -> None:
    """Record the autograd nodes of ``stage``'s backward for ``micro``; refuse a node a later stage's backward reached.

    With a split backward (``B`` keeps the graph for ``W``), the freed-buffer error that gives away a tensor crossing
    a split point unpassed comes only if the two stages' backward passes happen not to run the shared node at the
    same moment; this finds it every time. Leaf nodes (a parameter's accumulator, used by every stage) are not claimed."""
    for node in nodes:
        if not node.next_functions:
            continue
        other = micro.claimed.setdefault(node, stage)
        if other != stage:
            raise _crossing(split_points, stage, f"stage {other}'s backward also reached")


def _crossing(split_points: Sequence[str], stage: int, what: str) -> StagedStepError:
    return StagedStepError(
        f"stage {stage}'s backward reached a part of the graph that {what}: a tensor computed before one of the "
        f"split points {list(split_points)} is used after it without being passed to it (e.g. a skip connection "
        "around a split point). Pass it as an argument of the split point, or choose split points that no such "
        "connection crosses."
    )
