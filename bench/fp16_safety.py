"""What does making ``compression="fp16"`` safe cost per training step, and which safe design costs least?

torch's ``fp16_compress_hook`` casts before dividing: gradients above 65504 become inf (NaN
parameters, silently), below ~6e-8 become 0. Four ways of doing fp16 on the wire train the same
8M-parameter MLP (``bench/models.py``) with 2 processes, beside plain fp32 all-reduce:

    ddp_tuned      float32 all-reduce (DDP's built-in), the reference
    fp16_torch     torch's fp16_compress_hook: unsafe, the baseline the safe ones are compared with
    fp16_scaled    ours, ``compression="fp16"``: every rank scales the bucket by the same power of two,
                   divides, casts; no partial sum can overflow; inf/NaN gradients and underflow reported
                   (ScaledFp16Allreduce). On CPU the scale is carried over from the bucket's last step and
                   checked by the sum itself (float32 again where float16 could have overflowed)
    fp16_exchanged ours as it was before that: one scalar MAX all-reduce per bucket and step, waited for
                   on gloo (peak -> 2**15)
    fp16_checked   divide, cast, all-reduce, then the hook *waits* for the sum, checks it (identical on
                   every rank) and, where it overflowed, all-reduces that bucket again in float32
    fp16_skip      divide, cast, all-reduce; where the sum is not finite the bucket is zeroed (skip the
                   bucket's update this step) and a flag set for a warning; no extra collective, no wait

``fp16_checked``, ``fp16_skip`` and ``fp16_exchanged`` are implemented here only, to be measured.
``fp16_checked``'s fallback runs in the hook body: a collective issued from a completion callback
runs on gloo's worker threads and reaches the ranks in different orders (the reason
``comm/powersgd_memory.one_bucket_at_a_time`` exists), so the hook waits for its fp16 sum;
``fp16_skip`` loses a bucket's update instead; ours runs its fallback after DDP's end of the
backward, on the training thread. Loopback hides what a wait costs on a real link (the scalar
queues behind the previous bucket's transfer): ``python -m bench.netlab --sweep`` measures that.

Run it on a quiet machine (timings taken on a loaded one are noise):

    python -m bench.fp16_safety                 # 5 rounds x 5 launches, 100 timed steps each
    python -m bench.fp16_safety --quick         # smoke run: 1 round, 10 steps (the test runs this)
    python -m bench.fp16_safety --accelerator cuda --nproc 2   # NCCL: the MAX all-reduce is enqueued, not waited for

Method, timed span and rounds as ``bench/overhead.py`` (its docstring says why): every
configuration is its own ``torch.distributed.run`` launch of :mod:`bench.training`'s Lightning
loop, rounds rotate the order, the summary is the median over rounds of per-launch medians with
their spread. Writes ``--out`` (default bench/results/fp16_safety.json).
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
import torch.distributed as dist

from bench import RESULTS, training
from bench.harness import interleave
from bench.harness.report import write_json
from lightning_mgpu.comm.compression import ScaledFp16Allreduce

MODULE = "bench.fp16_safety"
CONFIGS = ("ddp_tuned", "fp16_torch", "fp16_scaled", "fp16_exchanged", "fp16_checked", "fp16_skip")
DEFAULT_OUT = RESULTS / "fp16_safety.json"
SKIPPED: list[torch.Tensor] = []  # fp16_skip's flags (one per bucket reduced), for its warning


# No annotations on the two hooks: DDP checks a hook's annotations and rejects strings (this module's are).
def fp16_checked_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """Divide, cast, sum; wait; where the fp16 sum is not finite, all-reduce the bucket again in float32."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.div(world_size).to(torch.float16)
    dist.all_reduce(compressed, group=group)  # waited for: the decision needs the sum
    low, high = torch.aminmax(compressed)
    if bool(torch.isfinite(low) & torch.isfinite(high)):  # the same sum, the same decision on every rank
        buffer.copy_(compressed)
    else:
        buffer.div_(world_size)
        dist.all_reduce(buffer, group=group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def fp16_skip_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """Divide, cast, sum; a bucket whose sum is not finite is zeroed and flagged."""
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    compressed = bucket.buffer().div(world_size).to(torch.float16)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):  # type: ignore[no-untyped-def]
        out = bucket.buffer()
        reduced = fut.value()[0]
        low, high = torch.aminmax(reduced)
        finite = torch.isfinite(low) & torch.isfinite(high)
        out.copy_(reduced)
        torch.where(finite, out, torch.zeros((), dtype=out.dtype), out=out)
        SKIPPED.append(~finite)
        return out

    return future.then(decompress)


class ExchangedScaleFp16(ScaledFp16Allreduce):
    """Ours with the scale exchanged at every step, as before the carried-over scale (measured, not offered)."""

    def _queue_fallback(self) -> bool:
        return False  # never carry a scale over: every bucket's peak is all-reduced with MAX and waited for


def register_configurations() -> None:
    """The strategy names the worker's Trainer is given (``bench.training`` builds the Trainer by name)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_mgpu import TunedDDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    for name, init in (
        ("fp16_torch", {"ddp_comm_hook": default_hooks.fp16_compress_hook}),
        ("fp16_scaled", {"compression": "fp16"}),
        ("fp16_exchanged", {"ddp_comm_hook": ExchangedScaleFp16()}),
        ("fp16_checked", {"ddp_comm_hook": fp16_checked_hook}),
        ("fp16_skip", {"ddp_comm_hook": fp16_skip_hook}),
    ):
        StrategyRegistry.register(name, TunedDDPStrategy, description=name, override=True, **init)
    training.CONFIGS = (*training.CONFIGS, *(c for c in CONFIGS if c not in training.CONFIGS))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        register_configurations()
        training.run_worker(args)
        return
    report = training.compare_launches("fp16_safety", MODULE, CONFIGS, args)
    out = write_json(args.out, report)
    training.print_launches(report, relative_to={"× fp16_torch": "fp16_torch", "× fp32": "ddp_tuned"}, iteration=False)
    safe = ("fp16_scaled", "fp16_exchanged", "fp16_checked", "fp16_skip")
    cheapest = min(safe, key=lambda name: report["summary"][name]["step_ms_median"])
    print(f"Cheapest safe design here: {cheapest}. Spreads wider than the differences mean: noise.")
    print(f"\n{report['wall_s']:.0f} s in all; wrote {out}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return interleave.parse_args(argv, doc=__doc__, default_out=DEFAULT_OUT, workers=CONFIGS)


if __name__ == "__main__":
    main()
