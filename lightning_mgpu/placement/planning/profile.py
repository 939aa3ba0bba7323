"""The one profiler: what each block of a model costs, measured by running the model's own forward and backward.

:func:`profile_blocks` runs the whole model (``run()``: one forward on one micro-batch, the
loss too where ``run`` computes it) ``repeats`` times after ``warmup`` untimed runs, with a
forward pre-hook on each block, and one backward of the result per run. So a model whose
forward is any Python (GPT-2's, a ResNet's) is measured as it runs, and an ``nn.Sequential``
(:func:`profile_layers`: its layers are the blocks) the same way. One :class:`LayerCost` per
block:

* ``forward_ms``: from the moment block ``i`` is entered to the moment block ``i + 1`` is (the
  code after the last block, the loss included, counts with the last block);
* ``backward_ms``: from the moment the gradient of block ``i + 1``'s input is computed to the
  moment block ``i``'s is (a tensor hook on the first input of each block that needs a
  gradient; the backward starts at the last block, and the first block's ends with the
  backward). Where a block's input needs no gradient (frozen layers before it), the blocks
  between two stamps share their time in proportion to their forward. Medians over the runs;
  ``time_spread_ms`` is the interquartile range of forward + backward. Host clock on CPU;
  CUDA events on GPU (read once, after all runs);
* ``activation_bytes``: the tensors autograd saves while block ``i`` runs (counted through
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once per block, parameters left
  out): what a stage keeps per micro-batch in flight;
* ``output_bytes``: the tensors that enter block ``i + 1`` (what crosses a cut after block
  ``i``; the result for the last block);
* ``param_bytes`` + ``grad_bytes`` + ``optimizer_bytes``: the parameters of the modules in
  block ``i``'s span by definition order (:func:`~.split_points.stage_of_modules`; each
  parameter once, where first registered), their gradients, and optimizer state at
  ``optimizer_state_factor`` times the gradient bytes (2 for Adam, 0 for plain SGD).

The code before the first block (embeddings, a stem) counts with the first block, or, with
``lead=True``, as a block of its own in front (``lightning-mgpu plan --split-points``: stage 0
begins at the model's start). Buffers (BatchNorm's running statistics) and the random state
are restored after, and gradients are not touched (``torch.autograd.grad``), so profiling
leaves the model as it was. It runs where the model is: in a fit, before placement (the CPU,
usually, whose times stand in for the devices').
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mgpu._checks import check_int, check_real
from lightning_mgpu._compat.torch import is_batchnorm
from lightning_mgpu.placement.planning.split_points import stage_of_modules

__all__ = ["LayerCost", "block_costs", "profile_batch_size", "profile_blocks", "profile_layers"]


@dataclass(frozen=True)
class LayerCost:
    """What one layer or block costs per micro-batch (see the module docstring for how each is measured)."""

    index: int
    name: str
    kind: str
    forward_ms: float
    backward_ms: float
    param_count: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    output_bytes: int
    time_spread_ms: float = 0.0  # interquartile range of forward + backward over the repeats: how stable the median is

    @property
    def time_ms(self) -> float:
        """Forward plus backward: the block's share of a training step per micro-batch."""
        return self.forward_ms + self.backward_ms

    @property
    def memory_bytes(self) -> int:
        """Parameters, gradients, optimizer state and one micro-batch's saved activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "time_ms": self.time_ms, "memory_bytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerCost:
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in data.items() if key in names})


def profile_batch_size(batch_size: int, microbatches: int, model: nn.Module) -> int:
    """Rows of the sample each block is measured on: one micro-batch (``ceil(N / M)``), but at least 2 when the
    model has BatchNorm (training-mode BatchNorm refuses one sample per channel). The fit and
    ``lightning-mgpu plan`` both use it, so they measure the same thing."""
    rows = max(1, -(-batch_size // microbatches))
    if rows < 2 <= batch_size and any(is_batchnorm(m) for m in model.modules()):
        return 2
    return rows


def block_costs(
    root: nn.Module, blocks: Sequence[str], *, lead: bool = False, optimizer_state_factor: float = 2.0
) -> list[LayerCost]:
    """One :class:`LayerCost` per block from its parameters only (no run: what ``balance="params"`` needs); the
    modules of each block's span by definition order, the code before the first block with it (``lead=True``: a
    block of its own in front, named ``(start)``)."""
    modules = dict(root.named_modules())
    spans = stage_of_modules(root, blocks)
    params: list[list[torch.Tensor]] = [[] for _ in range(len(blocks) + 1)]
    seen: set[int] = set()
    for name, module in root.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                params[spans.get(name, 0)].append(p)
    names = ["(start)", *blocks]
    kinds = [type(root).__name__, *(type(modules[name]).__name__ for name in blocks)]
    costs = []
    for span, tensors in enumerate(params):
        nbytes = sum(p.numel() * p.element_size() for p in tensors)
        trained = sum(p.numel() * p.element_size() for p in tensors if p.requires_grad)
        costs.append(
            LayerCost(
                index=span,
                name=names[span],
                kind=kinds[span],
                forward_ms=0.0,
                backward_ms=0.0,
                param_count=sum(p.numel() for p in tensors),
                param_bytes=nbytes,
                grad_bytes=trained,
                optimizer_bytes=int(round(trained * optimizer_state_factor)),
                activation_bytes=0,
                output_bytes=0,
            )
        )
    return costs if lead else _fold_lead(costs)


_SUMMED = (
    "forward_ms",
    "backward_ms",
    "param_count",
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "activation_bytes",
)


def _fold_lead(costs: list[LayerCost]) -> list[LayerCost]:
    """The lead span (before the first block) counted with the first block; indices from 0 again."""
    lead, first = costs[0], costs[1]
    merged = dataclasses.replace(first, **{name: getattr(lead, name) + getattr(first, name) for name in _SUMMED})
    return [dataclasses.replace(cost, index=i) for i, cost in enumerate([merged, *costs[2:]])]


def profile_blocks(
    root: nn.Module,
    blocks: Sequence[str],
    run: Callable[..., Any],
    *,
    prepare: Optional[Callable[[], Any]] = None,
    repeats: int = 5,
    warmup: int = 1,
    threads: Optional[int] = None,
    optimizer_state_factor: float = 2.0,
    lead: bool = False,
) -> list[LayerCost]:
    """One :class:`LayerCost` per block of ``root`` (qualified names), measured on ``run()`` (see the module
    docstring). ``run`` must call every block exactly once, in order; its result (a loss, or tensors) is what the
    backward starts from. ``prepare()``, where given, makes ``run``'s argument before the clock starts (a fresh copy
    of the input; its gradient is computed too where it requires one); ``threads``: intra-op threads while
    measuring (a pipeline stage's share of the machine)."""
    check_int("repeats", repeats)
    check_int("warmup", warmup, minimum=0)
    factor = check_real("optimizer_state_factor", optimizer_state_factor, what="a number >= 0")
    if factor < 0:
        raise ValueError(f"optimizer_state_factor must be a number >= 0, got {optimizer_state_factor!r}")
    modules = [root.get_submodule(name) for name in blocks]
    params = [p for p in root.parameters() if p.requires_grad]
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    spans = _Spans(len(modules), _Clock(device), {p.untyped_storage().data_ptr() for p in root.parameters()}, lead)
    handles = [module.register_forward_pre_hook(spans.enter(i), with_kwargs=True) for i, module in enumerate(modules)]
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    cuda = sorted({p.device.index for p in params if p.device.type == "cuda" and p.device.index is not None})
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads))
    try:
        with torch.random.fork_rng(devices=cuda), _on(device):
            for repeat in range(warmup + repeats):
                given = prepare() if prepare is not None else None
                spans.start()
                with torch.autograd.graph.saved_tensors_hooks(spans.pack, lambda tensor: tensor):
                    result = run(given) if prepare is not None else run()
                spans.forward_done(result)
                if len(spans.entered) != len(modules):
                    raise ValueError(
                        f"the model's forward entered {len(spans.entered)} of the {len(modules)} candidate blocks "
                        f"{list(blocks)}: every candidate must run exactly once per forward to be profiled"
                    )
                outputs = [t for t in _tensors(result) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
                wrt = [t for t in _tensors(given) if t.requires_grad] + params
                if outputs and wrt:
                    loss = torch.stack([t.float().sum() for t in outputs]).sum()
                    spans.backward_start()
                    torch.autograd.grad(loss, wrt, allow_unused=True)
                spans.backward_done(keep=repeat >= warmup)
    finally:
        torch.set_num_threads(previous_threads)
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    return spans.costs(block_costs(root, blocks, lead=True, optimizer_state_factor=factor))


def profile_layers(
    layers: nn.Sequential,
    sample: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: Union[str, torch.device, None] = None,
    optimizer_state_factor: float = 2.0,
    threads: Optional[int] = None,
) -> list[LayerCost]:
    """:func:`profile_blocks` for an ``nn.Sequential``: its layers are the blocks, ``sample`` (one micro-batch)
    the input, given afresh to every run (an in-place first layer never writes the caller's tensor; a gradient
    flows into it only where ``sample.requires_grad``). ``device``: where to measure (default: where the layers
    are); the layers are moved there and back. Every layer must return one tensor."""
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"profile_layers needs an nn.Sequential, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("profile_layers got an empty nn.Sequential: there is nothing to place")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(
            f"sample must be a torch.Tensor (one micro-batch of the sequential's input), got {type(sample).__name__}"
        )
    homes = [next(iter([*layer.parameters(), *layer.buffers()]), None) for layer in layers]
    target = torch.device(device) if device is not None else next((h.device for h in homes if h is not None), None)
    target = target or sample.device
    x = sample.detach().to(target, copy=True)

    def prepare() -> torch.Tensor:  # a copy, a leaf's copy where a gradient flows in: a layer may write it in place
        return x.detach().requires_grad_(sample.requires_grad).clone()

    def one_tensor(index: int, name: str) -> Callable[..., None]:
        def hook(layer: nn.Module, args: Any, out: Any) -> None:
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"layer {index} ({name}: {type(layer).__name__}) returns {type(out).__name__}; a pipeline passes "
                    "one tensor between layers, so every layer of the split nn.Sequential must return a tensor"
                )

        return hook

    names = [name for name, _ in layers.named_children()]
    checks = [
        layer.register_forward_hook(one_tensor(i, name)) for i, (name, layer) in enumerate(layers.named_children())
    ]
    layers.to(target)
    was_training = layers.training
    layers.train()
    try:
        return profile_blocks(
            layers,
            names,
            layers,
            prepare=prepare,
            repeats=repeats,
            warmup=warmup,
            threads=threads,
            optimizer_state_factor=optimizer_state_factor,
        )
    finally:
        layers.train(was_training)
        for handle in checks:
            handle.remove()
        for layer, home in zip(layers, homes):
            if home is not None and home.device != target:
                layer.to(home.device)


class _Spans:
    """The timed runs' stamps and counts, span by span: span 0 runs before the first block, span ``i + 1`` is block
    ``i``. Without ``lead``, span 0 shares span 1's count of saved storages (the two are reported as one block)."""

    def __init__(self, blocks: int, clock: _Clock, parameters: set[int], lead: bool) -> None:
        self.blocks, self.clock, self.parameters, self.lead = blocks, clock, parameters, lead
        self.runs: list[tuple[list[float], list[Optional[float]], list[int], list[int]]] = []
        self.entered: list[Any] = []

    def start(self) -> None:
        self.entered, self.current = [], 0
        self.seen: set[tuple[int, int]] = set()
        self.ready: list[Optional[Any]] = [None] * (self.blocks + 1)  # ready[i + 1]: block i's input gradient
        self.saved = [0] * (self.blocks + 1)
        self.crossing = [0] * (self.blocks + 1)  # crossing[s]: what leaves span s (enters block s)
        self.began: Any = self.clock.now()
        self.backward_began: Optional[Any] = None

    def enter(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.entered.append(self.clock.now())
            self.current = index + 1
            if index > 0 or self.lead:
                self.seen = set()
            tensors = _tensors((args, kwargs))
            self.crossing[index] = sum(t.numel() * t.element_size() for t in tensors)
            needs = next((t for t in tensors if t.requires_grad and (t.is_floating_point() or t.is_complex())), None)
            if needs is not None:
                needs.register_hook(self._stamp(index + 1))  # type: ignore[no-untyped-call]  # untyped in torch

        return hook

    def _stamp(self, span: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.ready[span] = self.clock.now()

        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some subclasses)
            key = (id(tensor), tensor.numel() * tensor.element_size())
        if key not in self.seen and key[0] not in self.parameters:
            self.seen.add(key)
            self.saved[self.current] += key[1]
        return tensor

    def forward_done(self, result: Any) -> None:
        self.ended = self.clock.now()
        self.crossing[self.blocks] = sum(t.numel() * t.element_size() for t in _tensors(result))

    def backward_start(self) -> None:
        self.backward_began = self.clock.now()

    def backward_done(self, *, keep: bool) -> None:
        done = self.clock.now()
        if keep:
            forward = [self.began, *self.entered, self.ended]
            began = self.backward_began if self.backward_began is not None else done
            # T_0 .. T_(n+1) in ms after the backward began: it runs from span n (T_(n+1) = 0) down to span 0 (T_0)
            marks = [done, *self.ready[1:], began]
            self.runs.append(
                (
                    [self.clock.elapsed_ms(a, b) for a, b in zip(forward, forward[1:])],
                    [None if mark is None else self.clock.elapsed_ms(began, mark) for mark in marks],
                    list(self.crossing),
                    list(self.saved),
                )
            )

    def costs(self, static: list[LayerCost]) -> list[LayerCost]:
        """``static`` (the spans' parameter costs, :func:`block_costs` with ``lead=True``) with what was measured."""
        forwards = [forward for forward, _, _, _ in self.runs]
        backwards = [_shared_out(marks, forward) for forward, marks, _, _ in self.runs]
        crossing, saved = self.runs[-1][2], self.runs[-1][3]
        if not self.lead:

            def fold(values: list[Any]) -> list[Any]:
                return [values[0] + values[1], *values[2:]]

            forwards, backwards = [fold(f) for f in forwards], [fold(b) for b in backwards]
            saved, crossing, static = fold(saved), crossing[1:], _fold_lead(static)
        return [
            dataclasses.replace(
                cost,
                forward_ms=statistics.median(f[span] for f in forwards),
                backward_ms=statistics.median(b[span] for b in backwards),
                time_spread_ms=_interquartile([f[span] + b[span] for f, b in zip(forwards, backwards)]),
                activation_bytes=saved[span],
                output_bytes=crossing[span],
            )
            for span, cost in enumerate(static)
        ]


def _shared_out(marks: Sequence[Optional[float]], forward: list[float]) -> list[float]:
    """Each span's backward ms from the marks ``T_0 .. T_(n+1)`` (span ``s`` runs from ``T_(s+1)`` to ``T_s``); the
    spans between two known marks share that time in proportion to their forward."""
    out = [0.0] * len(forward)
    known = [s for s, mark in enumerate(marks) if mark is not None]
    for a, b in zip(known, known[1:]):
        total = max(0.0, marks[a] - marks[b])  # type: ignore[operator]  # known: not None
        weights = forward[a:b]
        whole = sum(weights)
        for s in range(a, b):
            out[s] = total * (weights[s - a] / whole if whole > 0 else 1 / (b - a))
    return out


def _interquartile(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4, method="inclusive")
    return quartiles[2] - quartiles[0]


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists, dicts); for a training step's result or a Hugging Face output
    with a ``loss``, that loss alone."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping) and isinstance(value.get("loss"), torch.Tensor):
        return [value["loss"]]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _on(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Clock:
    """Host clock on CPU; CUDA events on GPU, all read once at the end (no per-run sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return float(end - start) * 1e3
