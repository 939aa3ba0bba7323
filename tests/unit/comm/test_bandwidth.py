"""nccl-tests' algbw / busbw definitions (doc/PERFORMANCE.md), checked against values worked out by hand."""

from __future__ import annotations

import math
import re
from typing import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_mgpu.comm import BYTES_PER_GB, COLLECTIVES, algbw_gbps, bus_factor, busbw_gbps


@pytest.mark.parametrize(
    ("collective", "world_size", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("all_reduce", 16, 1.875),
        ("all_gather", 2, 0.5),
        ("all_gather", 8, 0.875),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 8, 0.875),
        ("broadcast", 8, 1.0),
        ("reduce", 8, 1.0),
    ],
)
def test_bus_factor_known_values(collective: str, world_size: int, factor: float) -> None:
    assert bus_factor(collective, world_size) == pytest.approx(factor, rel=1e-15)


def test_one_process_moves_nothing_across_a_link() -> None:
    # The formulas as written: (n-1) = 0 for the collectives whose factor depends on n ...
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(collective, 1) == 0.0
        assert busbw_gbps(collective, 1e9, 1.0, 1) == 0.0
    # ... and nccl-tests' busbw = algbw for broadcast / reduce at any n.
    assert bus_factor("broadcast", 1) == bus_factor("reduce", 1) == 1.0


def test_names_are_forgiving_about_spelling() -> None:
    assert bus_factor("allreduce", 4) == bus_factor("ALL-REDUCE", 4) == bus_factor("all_reduce", 4)
    assert bus_factor("alltoall", 4) == bus_factor("all_to_all", 4)
    assert set(COLLECTIVES) == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"}


def test_algbw_is_bytes_per_second_in_decimal_gigabytes() -> None:
    assert BYTES_PER_GB == 1e9
    assert algbw_gbps(1e9, 1.0) == 1.0
    assert algbw_gbps(256 * 2**20, 0.001) == pytest.approx(268.435456)  # 256 MiB in 1 ms
    assert algbw_gbps(0, 0.5) == 0.0


def test_busbw_of_an_eight_gpu_all_reduce() -> None:
    # 1 GB in 10 ms on 8 ranks: algbw 100 GB/s, busbw 100 * 2 * 7 / 8 = 175 GB/s.
    assert busbw_gbps("all_reduce", 1e9, 0.01, 8) == pytest.approx(175.0)
    assert busbw_gbps("all_gather", 1e9, 0.01, 8) == pytest.approx(87.5)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: bus_factor("allreduce_sum", 2), "unknown collective 'allreduce_sum'; expected one of all_reduce"),
        (lambda: bus_factor("all_reduce", 0), "world_size must be an integer >= 1, got 0"),
        (lambda: bus_factor("all_reduce", 2.0), "world_size must be an integer >= 1, got 2.0"),
        (lambda: bus_factor("all_reduce", True), "world_size must be an integer >= 1, got True"),
        (lambda: algbw_gbps(-1, 1.0), "nbytes must be >= 0, got -1"),
        (lambda: algbw_gbps(1024, 0.0), "seconds must be > 0, got 0.0"),
        (lambda: algbw_gbps(1024, -1e-6), "seconds must be > 0"),
        (lambda: algbw_gbps(1024, math.nan), "seconds must be > 0, got nan"),
        (lambda: busbw_gbps("gather", 1024, 1.0, 2), "unknown collective 'gather'"),
        (lambda: busbw_gbps("all_reduce", 1024, 1.0, -3), "world_size must be an integer >= 1, got -3"),
    ],
)
def test_bad_inputs_raise_value_errors_that_say_what_was_given(call: Callable[[], float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@given(
    collective=st.sampled_from(COLLECTIVES),
    world_size=st.integers(min_value=1, max_value=4096),
    nbytes=st.integers(min_value=0, max_value=2**40),
    seconds=st.floats(min_value=1e-9, max_value=1e3),
)
def test_busbw_is_algbw_times_the_factor_and_never_exceeds_twice_algbw(
    collective: str, world_size: int, nbytes: int, seconds: float
) -> None:
    algbw = algbw_gbps(nbytes, seconds)
    busbw = busbw_gbps(collective, nbytes, seconds, world_size)
    assert busbw == pytest.approx(algbw * bus_factor(collective, world_size))
    assert 0.0 <= busbw <= 2 * algbw
    assert 0.0 <= bus_factor(collective, world_size) < 2.0
