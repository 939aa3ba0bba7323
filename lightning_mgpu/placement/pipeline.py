"""Micro-batch pipelining of an ``nn.Sequential`` split over several devices (GPipe fill-drain).

:class:`Pipeline` runs ``K`` stages, each on its own device, with **one worker thread per
stage**: the batch is cut into ``M`` micro-batches; stage ``j`` runs micro-batch ``i`` as
soon as stage ``j - 1`` has handed it over, so while stage 1 works on micro-batch 0,
stage 0 already runs micro-batch 1. Backward runs the same way in reverse. On CUDA each
device's kernels run on that device's stream and cross-device copies on a copy stream of
their own; on CPU every "cpu" stage gets ``threads_per_stage`` intra-op threads (default:
the process's threads divided among the stages), so two stages really run on two cores.

How gradients flow (and why this works under DDP)
-------------------------------------------------
Autograd runs every CPU backward on the thread that called it, so a single backward
over all stages could never overlap stages on CPU. The pipeline therefore keeps the
stages' graphs apart:

1. ``forward`` returns the concatenated output as a fresh leaf (``requires_grad=True``)
   on the input's device and remembers each micro-batch's stage inputs and outputs.
2. The ordinary ``loss.backward()`` stops at that leaf (its ``.grad`` is the gradient
   of the output).
3. :meth:`Pipeline.backward` (the hybrid strategy calls it right after ``loss.backward()``;
   ``post_backward``) runs the stages' backward in the worker threads, micro-batch by
   micro-batch, with ``torch.autograd.grad`` so nothing is accumulated yet; each stage
   sums its parameters' gradients over the micro-batches and then accumulates the sum
   into ``.grad`` with **one** ``torch.autograd.backward`` on the parameters themselves.
   So every parameter's gradient accumulator fires exactly once per step, which is what
   DDP's reducer requires, and the last stage's buckets are reduced while earlier stages
   are still computing. Finally the input gradient flows into whatever came before the
   split module (e.g. an embedding outside it).

Summing per-micro-batch weight gradients costs, for every micro-batch, a fresh weight-sized
tensor and one more pass over it. A stage's plain ``nn.Linear`` layers (exactly that class,
no hooks on them, directly in the stage or in plain ``nn.Sequential`` s inside it) avoid
both: their forward goes through a small autograd function whose backward adds
``grad_out^T @ input`` straight into the step's running sum (``addmm_``, the same
arithmetic an ``nn.Linear`` backward does) and hands autograd no weight gradient at all;
the sums then go through the single accumulation above. Under autocast, or with inputs of
another dtype or device than the weight, those layers run as usual.

Gradients equal those of the full batch whenever the layers treat samples independently
(no BatchNorm in training mode: it normalises per micro-batch), up to float summation
order. Parameters shared between the split module and the rest of the model are not
supported (they would receive two accumulations; the strategy refuses them).

Checkpointing (``checkpoint=``): ``"never"`` keeps every micro-batch's activations;
``"always"`` recomputes each stage's forward during backward
(``torch.utils.checkpoint``, non-reentrant, RNG state preserved); ``"except_last"``
recomputes all but the last micro-batch, whose backward starts at once (GPipe's choice).
Dropout draws from the device's generator: concurrent CPU stages share one, so the order
of draws (not their distribution) may differ from run to run; for the same reason
recomputation (``checkpoint != "never"``) of dropout layers over several CPU stages is
refused (the recomputed masks would differ). Not supported: using the pipelined module's
input elsewhere in the loss (a skip connection around it: a clear error says so) and
differentiating through it with ``torch.autograd.grad`` (its output is a fresh leaf).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from lightning_mgpu._compat.torch import global_module_hooks_registered, module_has_hooks

__all__ = ["CHECKPOINT_MODES", "Pipeline", "PipelineError", "check_recompute_randomness"]

CHECKPOINT_MODES = ("never", "except_last", "always")


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage, its device and the micro-batch."""


class _Abort:
    """Passed down a queue when an upstream stage failed, so nobody waits forever."""


@dataclass
class _Record:
    """One forward call whose backward is pending."""

    source: torch.Tensor  # the input as the caller gave it (may carry a graph from earlier layers)
    splits: list[int]  # micro-batch sizes
    inputs: list[list[Optional[torch.Tensor]]]  # [stage][micro-batch] detached input (requires_grad or None)
    outputs: list[list[torch.Tensor]]  # [stage][micro-batch] output with the stage's graph
    result: torch.Tensor  # the leaf handed back to the caller
    input_grads: list[Optional[torch.Tensor]] = field(default_factory=list)


class Pipeline:
    """Run ``stages`` (already on ``devices``) as a fill-drain pipeline of ``microbatches``.

    ``output_device``: where :meth:`forward` returns the output (default: the input's device,
    so a loss computed next to the targets just works).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[Union[str, torch.device]],
        *,
        microbatches: int = 1,
        checkpoint: str = "never",
        threads_per_stage: Optional[int] = None,
        output_device: Union[str, torch.device, None] = None,
    ) -> None:
        if len(stages) == 0 or len(stages) != len(devices):
            raise ValueError(f"need one device per stage and at least one stage: {len(stages)} stages, {len(devices)} devices")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        self.stages = list(stages)
        self.devices = [torch.device(device) for device in devices]
        self.microbatches = microbatches
        self.checkpoint = checkpoint
        self.output_device = None if output_device is None else torch.device(output_device)
        cpu_stages = sum(device.type == "cpu" for device in self.devices)
        if threads_per_stage is None:
            threads_per_stage = max(1, torch.get_num_threads() // max(1, cpu_stages))
        if isinstance(threads_per_stage, bool) or not isinstance(threads_per_stage, int) or threads_per_stage < 1:
            raise ValueError(f"threads_per_stage must be an integer >= 1, got {threads_per_stage!r}")
        self.threads_per_stage = threads_per_stage
        check_recompute_randomness(self.stages, checkpoint, self.devices)
        self._inplace_first = [_starts_in_place(stage) for stage in self.stages]
        self.params = [[p for p in stage.parameters() if p.requires_grad] for stage in self.stages]
        # per stage: {id(parameter): running sum} for the accumulating nn.Linear path
        self._linear_sums: list[dict[int, _GradSum]] = [{} for _ in self.stages]
        self._pending: list[_Record] = []
        self._workers: Optional[list[ThreadPoolExecutor]] = None
        self._copy_streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the pipelined module takes one tensor (batch first), got {type(x).__name__}")
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"the pipelined module needs a batch dimension with at least one sample, got shape {tuple(x.shape)}")
        chunks = list(x.tensor_split(min(self.microbatches, x.shape[0])))
        record_graph = torch.is_grad_enabled() and (x.requires_grad or any(self.params))
        grad_of_input = record_graph and x.requires_grad and (x.is_floating_point() or x.is_complex())
        modes = _thread_modes()
        k, m = len(self.stages), len(chunks)
        inputs: list[list[Optional[torch.Tensor]]] = [[None] * m for _ in range(k)]
        outputs: list[list[Any]] = [[None] * m for _ in range(k)]

        def run_stage(j: int, receive: Callable[[int], torch.Tensor], send: Callable[[int, torch.Tensor], None]) -> None:
            with self._stage_context(j, modes):
                # once per call (inside the stage's autocast/grad context), not per micro-batch
                run = (self._accumulating_forward(j) if record_graph else None) or self.stages[j]
                for i in range(m):
                    inp = receive(i)
                    if record_graph and (j > 0 or grad_of_input) and (inp.is_floating_point() or inp.is_complex()):
                        inp = inp.detach().requires_grad_()
                    else:
                        inp = inp.detach()
                    out = self._run_forward(j, run, i, m, inp, record_graph)
                    if record_graph:
                        inputs[j][i] = inp if inp.requires_grad else None
                        outputs[j][i] = out
                    send(i, out)

        outputs_sink: list[Any] = [None] * m
        self._execute(run_stage, chunks, outputs_sink, direction=1)
        target = self.output_device or x.device
        final = [self._transfer(out, target).detach() if out.device != target else out.detach() for out in outputs_sink]
        result = torch.cat(final) if len(final) > 1 else final[0].clone()
        if not record_graph:
            return result
        result.requires_grad_()
        with self._lock:
            self._pending.append(
                _Record(
                    source=x,
                    splits=[len(chunk) for chunk in chunks],
                    inputs=inputs,
                    outputs=outputs,
                    result=result,
                )
            )
        return result.clone()  # not the leaf itself: the caller may modify the output in place

    def _run_forward(
        self, j: int, run: Callable[[torch.Tensor], torch.Tensor], i: int, m: int, inp: torch.Tensor, record_graph: bool
    ) -> torch.Tensor:
        if inp.requires_grad and self._inplace_first[j]:
            inp = inp.clone()  # an in-place first layer cannot modify the leaf we differentiate against
        use_checkpoint = record_graph and (self.checkpoint == "always" or (self.checkpoint == "except_last" and i < m - 1))
        out = activation_checkpoint(run, inp, use_reentrant=False) if use_checkpoint else run(inp)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {j} returned {type(out).__name__}; every stage must return one tensor")
        return out

    def _accumulating_forward(self, j: int) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """Stage ``j``'s forward with its plain ``nn.Linear`` layers accumulating their own
        weight gradients (module docstring), or None where the stage must run as itself:
        not an ``nn.Sequential``, hooks that calling the layers directly would skip,
        autocast on, or no such layer."""
        stage = self.stages[j]
        if type(stage) is not nn.Sequential or module_has_hooks(stage) or global_module_hooks_registered() or _autocast_on():
            return None
        layers = [(layer, _accumulates(layer)) for layer in _flat_layers(stage)]
        if not any(fast for _, fast in layers):
            return None
        sums = self._linear_sums[j]

        def run(x: torch.Tensor) -> torch.Tensor:
            for layer, fast in layers:
                if fast and x.dtype == layer.weight.dtype and x.device == layer.weight.device:
                    bias = layer.bias if layer.bias is not None and layer.bias.requires_grad else None
                    weight_sum = sums.setdefault(id(layer.weight), _GradSum())
                    bias_sum = sums.setdefault(id(bias), _GradSum()) if bias is not None else None
                    x = _AccumulatingLinear.apply(x, layer.weight, layer.bias, weight_sum, bias_sum)
                else:
                    x = layer(x)
            return x

        return run

    # ------------------------------------------------------------------ backward
    @property
    def has_pending_backward(self) -> bool:
        return bool(self._pending)

    def pending_with_grad(self) -> int:
        """Forward calls whose output received a gradient but whose stages' backward has not run."""
        with self._lock:
            return sum(record.result.grad is not None for record in self._pending)

    def discard_pending(self) -> None:
        """Forget forward calls whose backward never came (e.g. a skipped step)."""
        with self._lock:
            self._pending.clear()

    def backward(self) -> None:
        """Backward through every forward since the last call (see the module docstring)."""
        with self._lock:
            # Outputs without a gradient yet (e.g. a second loss whose manual_backward comes later) stay pending.
            records = [r for r in self._pending if r.result.grad is not None]
            self._pending = [r for r in self._pending if r.result.grad is None]
        if not records:
            return
        grads_in: list[list[torch.Tensor]] = []
        for record in records:
            grad = record.result.grad
            record.result.grad = None
            grads_in.append(list(grad.split(record.splits)))
        # Work items in order: the latest forward first, each micro-batch last-to-first.
        items = [(r, i) for r in reversed(range(len(records))) for i in reversed(range(len(records[r].splits)))]
        for record in records:
            record.input_grads = [None] * len(record.splits)

        def run_stage(j: int, receive: Callable[[int], torch.Tensor], send: Callable[[int, torch.Tensor], None]) -> None:
            params = self.params[j]
            sums: list[Optional[torch.Tensor]] = [None] * len(params)
            linear_sums = self._linear_sums[j]
            for running in linear_sums.values():
                running.value = None  # nothing left over from a backward that failed half-way
            with self._stage_context(j, {}):
                for n, (r, i) in enumerate(items):
                    record = records[r]
                    grad_out = receive(n)
                    out, inp = record.outputs[j][i], record.inputs[j][i]
                    wrt = ([inp] if inp is not None else []) + params
                    if out.requires_grad and wrt:
                        grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
                    else:
                        grads = (None,) * len(wrt)
                    record.outputs[j][i] = None  # free the graph as we go
                    if inp is not None:
                        grad_in = grads[0] if grads[0] is not None else torch.zeros_like(inp)
                        grads = grads[1:]
                    else:
                        grad_in = None
                    for p, g in enumerate(grads):
                        if g is None:
                            continue
                        if sums[p] is None:
                            # autograd may hand back one tensor as both the input's and a parameter's
                            # gradient (x + p): never accumulate into what was sent upstream.
                            aliased = grad_in is not None and g.data_ptr() == grad_in.data_ptr()
                            sums[p] = g.clone() if aliased else g
                        else:
                            sums[p].add_(g)
                    send(n, grad_in)
                for p, param in enumerate(params):
                    running = linear_sums.get(id(param))
                    if running is None or running.value is None:
                        continue
                    own, running.value = running.value, None
                    sums[p] = own if sums[p] is None else sums[p].add_(own)
                ready = [(p, g) for p, g in zip(params, sums) if g is not None]
                if ready:
                    # One accumulation per parameter per step: DDP's reducer hooks fire once, here.
                    torch.autograd.backward([p for p, _ in ready], [g for _, g in ready])

        first_grads = [None] * len(items)
        self._execute(
            run_stage,
            [grads_in[r][i] for r, i in items],
            first_grads,
            direction=-1,
        )
        for n, (r, i) in enumerate(items):
            records[r].input_grads[i] = first_grads[n]
        roots, grads = [], []
        for record in records:
            if record.source.requires_grad and all(g is not None for g in record.input_grads):
                grad = torch.cat([self._transfer(g, record.source.device) for g in record.input_grads])
                roots.append(record.source)
                grads.append(grad.reshape(record.source.shape))
        if roots:
            try:
                torch.autograd.backward(roots, grads)
            except RuntimeError as exc:
                if "backward through the graph a second time" not in str(exc):
                    raise
                raise RuntimeError(
                    "the pipelined module's input is also used elsewhere in the loss (e.g. a skip connection around "
                    "the split nn.Sequential, or an auxiliary loss on its input): its graph was already freed by "
                    "loss.backward(). Move the skip connection inside the split module (a layer that returns "
                    "f(x) + x), or detach the other use."
                ) from exc

    # ------------------------------------------------------------------ execution
    def _execute(
        self,
        run_stage: Callable[[int, Callable[[int], Any], Callable[[int, Any], None]], None],
        feed: list[Any],
        sink: list[Any],
        *,
        direction: int,
    ) -> None:
        """Run ``run_stage(j, receive, send)`` for every stage, chained in ``direction``.

        Stage order is 0..K-1 for forward (direction 1) and K-1..0 for backward (-1). The
        first stage receives ``feed[n]``; what the last one sends lands in ``sink[n]``.
        """
        k = len(self.stages)
        order = list(range(k)) if direction == 1 else list(reversed(range(k)))
        if k == 1:
            j = order[0]
            run_stage(j, lambda n: self._transfer(feed[n], self.devices[j]), sink.__setitem__)
            return
        queues = {j: queue.SimpleQueue() for j in order}

        def receiver(position: int) -> Callable[[int], Any]:
            j = order[position]
            if position == 0:
                return lambda n: self._transfer(feed[n], self.devices[j])

            def receive(n: int) -> Any:
                item = queues[j].get()
                if isinstance(item, _Abort):
                    raise _Aborted()
                return item

            return receive

        def sender(position: int) -> Callable[[int, Any], None]:
            if position == k - 1:
                return sink.__setitem__
            nxt = order[position + 1]
            return lambda n, value: queues[nxt].put(None if value is None else self._transfer(value, self.devices[nxt]))

        def task(position: int) -> None:
            try:
                run_stage(order[position], receiver(position), sender(position))
            except BaseException:
                if position < k - 1:
                    queues[order[position + 1]].put(_Abort())
                raise

        workers = self._get_workers()
        futures: list[Future] = [workers[order[position]].submit(task, position) for position in range(k)]
        errors = []
        for position, future in enumerate(futures):
            try:
                future.result()
            except _Aborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised below with the stage named
                errors.append((order[position], exc))
        if errors:
            j, exc = errors[0]
            phase = "forward" if direction == 1 else "backward"
            raise PipelineError(f"pipeline stage {j} on {self.devices[j]} failed in {phase}: {type(exc).__name__}: {exc}") from exc

    def _stage_context(self, j: int, modes: dict[str, Any]) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        device = self.devices[j]
        if device.type == "cpu":
            previous = torch.get_num_threads()
            torch.set_num_threads(self.threads_per_stage)
            stack.callback(torch.set_num_threads, previous)
        elif device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        if modes:
            stack.enter_context(torch.set_grad_enabled(modes["grad"]))
            for device_type, (enabled, dtype) in modes["autocast"].items():
                if enabled:
                    stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
        return stack

    def _get_workers(self) -> list[ThreadPoolExecutor]:
        # One thread per stage, the same one for forward and backward: a stage's tensors are
        # allocated and freed by one thread (cross-thread frees made glibc return and re-fault
        # memory on every micro-batch), and its device and thread settings stay put.
        if self._workers is None:
            self._workers = [
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lightning_mgpu-stage{j}") for j in range(len(self.stages))
            ]
        return self._workers

    def _transfer(self, tensor: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """Move a boundary tensor; on CUDA through a copy stream the consumer's stream waits for."""
        if tensor is None or tensor.device == device:
            return tensor
        if device.type != "cuda":
            return tensor.to(device)  # device -> host (or cpu -> cpu-like): a plain, synchronous copy
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device=device)
        consumer = torch.cuda.current_stream(device)
        if tensor.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            moved = tensor.to(device, non_blocking=True)
        consumer.wait_stream(stream)
        if tensor.is_cuda:
            tensor.record_stream(stream)
        moved.record_stream(consumer)
        return moved

    def close(self) -> None:
        """Stop the worker threads and drop pending graphs."""
        self.discard_pending()
        if self._workers is not None:
            for worker in self._workers:
                worker.shutdown(wait=True)
            self._workers = None


def _starts_in_place(stage: nn.Module) -> bool:
    """Whether the first leaf module a stage runs is an in-place one (``nn.ReLU(inplace=True)``)."""
    module = stage
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    return bool(getattr(module, "inplace", False))


_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def check_recompute_randomness(stages: Sequence[nn.Module], checkpoint: str, devices: Optional[Sequence[Any]]) -> None:
    """Refuse activation recomputation of dropout layers when several stages share the CPU's generator.

    Recomputation replays a stage's forward with the random state saved before it; with
    several CPU stages running concurrently, other stages draw from the same global generator
    in between, so the recomputed dropout masks would differ from the forward's and the
    gradients would be wrong (not just nondeterministic).
    """
    if checkpoint == "never" or devices is None:
        return
    cpu_stages = sum(torch.device(device).type == "cpu" for device in devices)
    if cpu_stages < 2:
        return
    if any(isinstance(module, _RANDOM_LAYERS) for stage in stages for module in stage.modules()):
        raise ValueError(
            f"checkpoint={checkpoint!r} with dropout in a model split over {cpu_stages} CPU stages: the stages share "
            "the CPU's random generator, so recomputed dropout masks would differ from the forward's and the gradients "
            "would be wrong. Use checkpoint='never', or put the stages on GPUs (one generator each)."
        )


class _Aborted(Exception):
    """A stage stopped because an upstream stage failed (the upstream error is reported)."""


def _thread_modes() -> dict[str, Any]:
    """Grad mode and autocast of the calling thread, to re-create in the stage workers."""
    autocast = {}
    for device_type in ("cpu", "cuda"):
        try:
            autocast[device_type] = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        except (RuntimeError, TypeError):  # pragma: no cover - older torch signatures
            continue
    return {"grad": torch.is_grad_enabled(), "autocast": autocast}


class _GradSum:
    """One parameter's gradient summed over a step's micro-batches (None before the first)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[torch.Tensor] = None


class _AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight (and bias) gradient into running sums
    instead of returning it: no weight-sized tensor per micro-batch, no extra pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        weight_sum: _GradSum,
        bias_sum: Optional[_GradSum],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sums = (weight_sum, bias_sum)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        weight_sum, bias_sum = ctx.sums
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        rows_out = grad_out.reshape(-1, grad_out.shape[-1])
        rows_in = x.reshape(-1, x.shape[-1])
        if weight_sum.value is None:
            weight_sum.value = rows_out.t().matmul(rows_in)
        else:
            weight_sum.value.addmm_(rows_out.t(), rows_in)
        if bias_sum is not None:
            bias_grad = rows_out.sum(0)
            bias_sum.value = bias_grad if bias_sum.value is None else bias_sum.value.add_(bias_grad)
        return grad_x, None, None, None, None


def _flat_layers(module: nn.Module) -> Any:
    """The layers a plain ``nn.Sequential`` runs, nested plain ``nn.Sequential`` s opened up."""
    if type(module) is nn.Sequential and not module_has_hooks(module):
        for child in module:
            yield from _flat_layers(child)
    else:
        yield module


def _accumulates(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and layer.weight.requires_grad and not module_has_hooks(layer)


def _autocast_on() -> bool:
    return any(enabled for enabled, _ in _thread_modes()["autocast"].values())
