"""``lightning-mgpu plan --split-points``: what each stage of an unmodified model would hold and take.

The model runs forward and backward on one micro-batch of ``--shape`` (its forward's input),
``--repeats`` times after a warm-up; forward pre-hooks on the split points stamp where each
stage's forward begins, and the backward is shared out in proportion to the forward. Each
stage's parameters, gradients and optimizer state (Adam: twice the parameters) are counted
from the modules it holds (:func:`lightning_mgpu.placement.planning.split_points.stage_of_modules`); a
parameter used by two stages (tied embeddings) is counted where it lives, the first of them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def plan_split_points(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: Any, shape: list[int], device: Any, threads: int
) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from lightning_mgpu.placement.planning.profile import profile_batch_size
    from lightning_mgpu.placement.planning.split_points import check_split_points, stage_of_modules

    points = [point.strip() for point in args.split_points.split(",") if point.strip()]
    try:
        check_split_points(model, points, len(points) + 1)
    except ValueError as exc:
        parser.error(f"argument --split-points: {exc}")
    rows = profile_batch_size(shape[0], args.microbatches, model)
    dtype = {"long": torch.long, "int": torch.int}.get(args.dtype) or getattr(torch, args.dtype)
    sample_shape = (rows, *shape[1:])
    sample = (
        torch.randint(0, args.high, sample_shape, dtype=dtype)
        if dtype in (torch.long, torch.int)
        else torch.randn(sample_shape, dtype=dtype)
    ).to(device)
    model.to(device).train()
    stamps: list[float] = []
    handles = [
        model.get_submodule(point).register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter()))
        for point in points
    ]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    forward: list[list[float]] = []
    backward: list[float] = []
    try:
        for repeat in range(1 + args.repeats):
            stamps.clear()
            start = time.perf_counter()
            out = model(sample)
            end = time.perf_counter()
            tensors = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            loss = sum(t.float().sum() for t in tensors)
            torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
            done = time.perf_counter()
            if len(stamps) != len(points):
                parser.error(f"argument --split-points: {len(stamps)} of {len(points)} split points ran in one forward")
            if repeat:
                edges = [start, *stamps, end]
                forward.append([(b - a) * 1e3 for a, b in zip(edges, edges[1:])])
                backward.append((done - end) * 1e3)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        parser.error(f"running the model on a sample of shape {list(sample_shape)} ({args.dtype}) failed: {exc}")
    finally:
        torch.set_num_threads(previous)
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    stages = stage_of_modules(model, points)
    k = len(points) + 1
    params = [0] * k
    seen: set[int] = set()
    for name, sub in model.named_modules():
        for p in sub.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                params[stages.get(name, 0)] += p.numel() * p.element_size()
    fwd = [statistics.median(run[j] for run in forward) for j in range(k)]
    total_fwd, total_bwd = sum(fwd) or 1.0, statistics.median(backward)
    times = [f + total_bwd * f / total_fwd for f in fwd]
    table = Table(
        title=f"{args.factory}: split points {points}, micro-batch {list(sample_shape)}, M={args.microbatches}"
    )
    for column in ("stage", "begins at", "time ms", "params+grads+Adam"):
        table.add_column(column, justify="left" if column == "begins at" else "right")
    for j in range(k):
        table.add_row(
            str(j), "(start)" if j == 0 else points[j - 1], f"{times[j]:.3f}", f"{4 * params[j] / 2**20:.1f} MiB"
        )
    table.caption = f"slowest stage {max(times):.3f} ms; balance {sum(times) / k / max(times):.0%}; {threads} thread(s)"
    Console().print(table)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "factory": args.factory,
                    "split_points": points,
                    "stage_time_ms": times,
                    "stage_param_bytes": params,
                    "sample_shape": list(sample_shape),
                },
                handle,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
