"""Algorithm and bus bandwidth of a collective, exactly as nccl-tests defines them.

Source: nccl-tests, ``doc/PERFORMANCE.md`` (https://github.com/NVIDIA/nccl-tests):

* ``algbw = S / t``: the size of the operation over the time it took.
* ``busbw = algbw * factor``, where the factor turns algbw into the bandwidth each rank's
  link had to sustain, so the number can be compared with the hardware's peak (NVLink,
  PCIe, network) whatever the number of ranks ``n``:

  ==============  ==============
  collective      factor
  ==============  ==============
  all_reduce      2 (n - 1) / n
  reduce_scatter  (n - 1) / n
  all_gather      (n - 1) / n
  all_to_all      (n - 1) / n
  broadcast       1
  reduce          1
  ==============  ==============

Conventions, the same as nccl-tests so that our numbers and theirs compare 1:1:

* ``S`` (``nbytes`` below) is the size nccl-tests prints in its ``size`` column: the buffer
  each rank reduces for all_reduce / reduce / broadcast, and the *whole* gathered or
  scattered array (``n`` x the per-rank chunk) for all_gather and reduce_scatter.
* GB/s means 10^9 bytes per second (not GiB/s), as nccl-tests' ``bwUnit = 1.0E9``.
* One process (``n == 1``): the formulas are applied as written, with no special case.
  That makes the factor 0 for all_reduce, all_gather, reduce_scatter and all_to_all
  (nothing crosses a link, so there is no bus bandwidth to speak of) and leaves it 1 for
  broadcast and reduce (nccl-tests reports busbw = algbw for them at any ``n``).

Pure Python, no torch import: the communication profiler and the CLI can use it anywhere.
"""

from __future__ import annotations

BYTES_PER_GB = 1e9
"""GB/s in this package is 10^9 bytes per second, as in nccl-tests."""

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
"""Collective names :func:`bus_factor` knows ("allreduce", "all-reduce", ... are accepted too)."""

_ALIASES = {name.replace("_", ""): name for name in COLLECTIVES}


def _canonical_collective(collective: str) -> str:
    key = str(collective).strip().lower().replace("_", "").replace("-", "")
    if key not in _ALIASES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")
    return _ALIASES[key]


def bus_factor(collective: str, world_size: int) -> float:
    """The factor nccl-tests multiplies algbw by to get busbw, for ``world_size`` ranks.

    >>> bus_factor("all_reduce", 8)
    1.75
    >>> bus_factor("all_gather", 4)
    0.75
    """
    name = _canonical_collective(collective)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    n = world_size
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce: all data leaves (or reaches) the root through one link


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth ``nbytes / seconds`` in GB/s (10^9 bytes per second)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not seconds > 0:  # also rejects NaN
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return nbytes / seconds / BYTES_PER_GB


def busbw_gbps(collective: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw_gbps` times :func:`bus_factor`.

    ``nbytes`` follows nccl-tests' size convention (see the module docstring): for
    all_gather and reduce_scatter it is the whole array, ``world_size`` x the per-rank chunk.
    """
    factor = bus_factor(collective, world_size)
    return algbw_gbps(nbytes, seconds) * factor


__all__ = ["BYTES_PER_GB", "COLLECTIVES", "algbw_gbps", "bus_factor", "busbw_gbps"]
