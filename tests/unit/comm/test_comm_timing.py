"""Interval arithmetic and bucket timing, deterministic: a patched clock, no processes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_mgpu.callbacks.comm_profiler import CommProfiler
from lightning_mgpu.comm.compression import PrescaledAllreduce
from lightning_mgpu.comm.allreduce_bench import SCHEMA_VERSION
from tests.conftest import REPO
from lightning_mgpu.comm.timing import BucketInterval, BucketTimer, HostClock, StepTimeline, step_breakdown, union_ms


def bucket(index: int, launch: float, done: float, nbytes: int = 1000, wire: int = 1000) -> BucketInterval:
    return BucketInterval(index=index, bytes=nbytes, wire_bytes=wire, num_params=2, launch_ms=launch, done_ms=done)


def timeline(*buckets: BucketInterval, compute_end: Any = None, forward_end: float = 2.0) -> StepTimeline:
    return StepTimeline(
        step=1,
        rank=0,
        start_ns=0,
        forward_end_ms=forward_end,
        compute_end_ms=compute_end,
        backward_end_ms=12.0,
        optimizer_start_ms=12.5,
        step_ms=14.0,
        buckets=tuple(buckets),
    )


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([], 0.0),
        ([(1.0, 3.0)], 2.0),
        ([(1.0, 3.0), (5.0, 6.0)], 3.0),  # disjoint
        ([(1.0, 4.0), (2.0, 3.0)], 3.0),  # nested
        ([(1.0, 4.0), (3.0, 6.0), (5.5, 7.0)], 6.0),  # chained overlaps
        ([(5.0, 6.0), (1.0, 2.0), (1.5, 5.0)], 5.0),  # unsorted
        ([(2.0, 2.0)], 0.0),
    ],
)
def test_union_of_concurrent_buckets(intervals: list[tuple[float, float]], expected: float) -> None:
    assert union_ms(intervals) == pytest.approx(expected)


def test_union_rejects_reversed_interval() -> None:
    with pytest.raises(ValueError, match="ends before it starts"):
        union_ms([(3.0, 1.0)])


def test_fully_hidden_communication() -> None:
    # compute ends at 10; both buckets are done by 9: nothing exposed
    b = step_breakdown(timeline(bucket(0, 4.0, 7.0), bucket(1, 6.0, 9.0), compute_end=10.0))
    assert b.comm_ms == pytest.approx(5.0)
    assert b.comm_busy_ms == pytest.approx(5.0)
    assert b.exposed_comm_ms == 0.0
    assert b.overlap_ratio == 1.0
    assert b.backward_compute_ms == pytest.approx(8.0)  # forward ended at 2


def test_partly_exposed_communication() -> None:
    # span 4 -> 12 = 8 ms; compute ends at 10: 2 ms exposed, 75% hidden
    b = step_breakdown(timeline(bucket(0, 4.0, 8.0), bucket(1, 10.0, 12.0), compute_end=10.0))
    assert b.comm_ms == pytest.approx(8.0)
    assert b.comm_busy_ms == pytest.approx(6.0)  # a gap between 8 and 10
    assert b.exposed_comm_ms == pytest.approx(2.0)
    assert b.overlap_ratio == pytest.approx(0.75)
    assert b.optimizer_ms == pytest.approx(1.5)
    assert b.bytes == 2000


def test_compute_end_never_before_the_last_launch() -> None:
    # no engine-callback stamp: the last bucket's launch is when the last gradient was ready
    b = step_breakdown(timeline(bucket(0, 4.0, 8.0), bucket(1, 9.0, 11.0)))
    assert b.backward_compute_ms == pytest.approx(7.0)
    assert b.exposed_comm_ms == pytest.approx(2.0)
    stale = step_breakdown(timeline(bucket(0, 4.0, 8.0), bucket(1, 9.0, 11.0), compute_end=5.0))
    assert stale.backward_compute_ms == pytest.approx(7.0)


def test_step_without_buckets_reports_compute_only() -> None:
    b = step_breakdown(timeline())
    assert (b.comm_ms, b.exposed_comm_ms, b.overlap_ratio, b.bytes) == (0.0, 0.0, 0.0, 0)
    assert b.backward_compute_ms == pytest.approx(10.0)


class FakeClock(HostClock):
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0

    def stamp(self) -> int:
        return self.now


class FakeBucket:
    def __init__(self, index: int, numel: int) -> None:
        self._index, self._buffer = index, torch.zeros(numel)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return [self._buffer[:1], self._buffer[1:]]


def test_bucket_timer_stamps_launch_and_completion() -> None:
    clock = FakeClock()
    queued: list[Any] = []
    timer = BucketTimer(clock, queue_callback=queued.append)
    timer.wire_ratio = 0.5
    pending: dict[int, torch.futures.Future] = {}

    def inner_hook(state: Any, b: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        pending[b.index()] = fut
        return fut

    hook = timer.wrap(inner_hook)
    assert hook.__name__ == "timed_inner_hook"
    clock.now = 1_000_000  # 1 ms
    out0 = hook(None, FakeBucket(0, 250))  # 1000 bytes
    clock.now = 3_000_000
    out1 = hook(None, FakeBucket(1, 500))
    assert len(queued) == 1  # one compute-end callback per backward, queued at the first bucket
    clock.now = 4_000_000
    pending[0].set_result(torch.ones(1))
    clock.now = 6_500_000
    queued[0]()  # autograd finished the backward graph
    clock.now = 7_000_000
    pending[1].set_result(torch.ones(1))
    assert out0.wait().item() == 1.0 and out1.done()  # values pass through untouched

    launches, dones, compute_end = timer.take()
    intervals = timer.intervals(0, launches, dones)
    assert [(b.index, b.bytes, b.wire_bytes, b.num_params) for b in intervals] == [
        (0, 1000, 500, 2),
        (1, 2000, 1000, 2),
    ]
    assert [(b.launch_ms, b.done_ms) for b in intervals] == [(1.0, 4.0), (3.0, 7.0)]
    assert compute_end == 6_500_000
    assert timer.take() == ([], [], None)  # the next step starts empty


def test_profiler_rejects_bad_arguments(tmp_path: Any) -> None:
    for kwargs, name in [
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"timeline_steps": -1}, "timeline_steps"),
        ({"history": 1.5}, "history"),
        ({"warmup_steps": True}, "warmup_steps"),
        ({"profile_steps": 0}, "profile_steps"),
        ({"profile_every": 0}, "profile_every"),
        ({"profile_every": 25}, "profile_every"),  # 5 warm-up + 20 profiled: no step left outside
        ({"profile_steps": 3, "profile_every": 5}, "profile_every"),  # 2 settling + 3 profiled after a re-wrap
    ]:
        with pytest.raises(ValueError, match=name):
            CommProfiler(**kwargs)
    with pytest.raises(ValueError, match="sweep="):
        CommProfiler(sweep=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(f'{{"schema_version": {SCHEMA_VERSION}, "peak_busbw_gbps": 0}}')
    with pytest.raises(ValueError, match="expected > 0"):
        CommProfiler(sweep=bad)
    halves = tmp_path / "float16.json"  # bench-comm --dtype float16 alone: not the ceiling of float32 gradients
    halves.write_text(f'{{"schema_version": {SCHEMA_VERSION}, "peak_busbw_gbps": 1.0, "dtype": "float16"}}')
    with pytest.raises(ValueError, match="a float16 sweep only"):
        CommProfiler(sweep=halves)


def test_profiling_windows_follow_the_schedule() -> None:
    """Window 0 after the warm-up, later windows after 2 settling steps of the new DDP wrapper."""
    profiler = CommProfiler(warmup_steps=3, profile_steps=4, profile_every=10)
    phases = "".join(profiler._phase(n)[0] for n in range(1, 31))  # s(kip), p(rofile), o(ff)
    assert phases == "sssppppooo" + "ssppppoooo" * 2
    assert CommProfiler(warmup_steps=2, profile_steps=1, profile_every=4)._phase(5) == "skip"
    every = CommProfiler(warmup_steps=3, profile_every=None)
    assert "".join(every._phase(n)[0] for n in range(1, 9)) == "sssppppp"
    assert CommProfiler().profile_steps == 20 and CommProfiler().profile_every == 200


def test_only_pausable_wrappers_leave_ddp_and_only_when_that_restores_the_builtin_all_reduce() -> None:
    from lightning_mgpu import TunedDDPStrategy

    strategy = TunedDDPStrategy()
    assert not strategy.has_own_comm_hook
    strategy.add_comm_hook_wrapper(lambda hook: hook, pausable=True)
    assert not strategy.has_own_comm_hook  # off, DDP would run its C++ all-reduce: worth a re-wrap
    strategy.add_comm_hook_wrapper(lambda hook: hook)  # a user's wrapper: a Python hook in any case
    assert strategy.has_own_comm_hook
    assert strategy.set_comm_hook_wrappers(False) and not strategy.comm_hook_wrappers_on
    assert TunedDDPStrategy(compression="fp16").has_own_comm_hook


def test_a_switch_is_never_made_after_the_last_step() -> None:
    from types import SimpleNamespace

    from lightning_mgpu.callbacks.comm_profiler.callback import _fit_ends_here

    def trainer(**kw: Any) -> Any:
        state = {
            "should_stop": False,
            "max_steps": -1,
            "global_step": 10,
            "current_epoch": 0,
            "max_epochs": 3,
            "is_last_batch": False,
            **kw,
        }
        epoch_loop = SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=state["is_last_batch"]))
        fit_loop = SimpleNamespace(max_epochs=state["max_epochs"], epoch_loop=epoch_loop)
        return SimpleNamespace(
            fit_loop=fit_loop, **{k: state[k] for k in ("should_stop", "max_steps", "global_step", "current_epoch")}
        )

    assert not _fit_ends_here(trainer())
    assert _fit_ends_here(trainer(should_stop=True))  # EarlyStopping
    assert _fit_ends_here(trainer(max_steps=10)) and not _fit_ends_here(trainer(max_steps=11))
    assert _fit_ends_here(trainer(current_epoch=2, is_last_batch=True))
    assert not _fit_ends_here(trainer(current_epoch=1, is_last_batch=True))
    assert not _fit_ends_here(trainer(current_epoch=2, is_last_batch=True, max_epochs=-1))


def test_profiler_reads_a_bench_comm_result() -> None:
    sweep = REPO / "bench" / "results" / "bench_comm_cpu.json"
    profiler = CommProfiler(sweep=sweep)
    peak = json.loads(sweep.read_text())["peak_busbw_gbps"]
    assert peak > 0 and profiler.peak_busbw_gbps == pytest.approx(peak)


def test_prescaling_puts_the_average_on_the_loss_for_one_backward_only() -> None:
    prescaler = PrescaledAllreduce(world_size=4)
    weight = torch.ones(3, requires_grad=True)
    seen: list[bool] = []
    weight.register_hook(lambda grad: seen.append(prescaler._prescaled))  # what a bucket hook would see
    loss = (weight * 2).sum()
    prescaler.prescale(loss)
    loss.backward()
    assert torch.equal(weight.grad, torch.full((3,), 0.5))  # 2 / 4: already averaged
    assert seen == [True] and prescaler._prescaled is False  # reset when the backward ended
    weight.grad = None
    (weight * 2).sum().backward()  # a raw backward: not prescaled, the hook must divide
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    assert seen == [True, False]
