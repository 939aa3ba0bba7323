"""Predict before you scale: one profiled step replayed on another system (pure Python).

From a ``comm_profile.json`` written by :class:`~lightning_mgpu.CommProfiler`, predict the
step time at another world size, over another link, with another bucket size or compression,
on a faster device; rank the changes that would help most. ``lightning-mgpu whatif`` is the
command; ``docs/whatif.md`` describes the model, its sources and its limits.

* :mod:`~.records`: the profile as records (:func:`load_profile`);
* :mod:`~.links`: links, named presets with sources, measured ones;
* :mod:`~.compression`: what a compression hook sends and computes per bucket;
* :mod:`~.model`: the replay (:class:`System`, :class:`Scenario`, :func:`predict`);
* :mod:`~.levers`: the levers ranked, and :func:`what_would_help` for the profiler;
* :mod:`~.measure` (torch) and :mod:`~.plot` (matplotlib), imported only when used.
"""

from lightning_mgpu.whatif.compression import COMPRESSIONS, CompressionCosts
from lightning_mgpu.whatif.levers import Advice, Lever, rank_levers, what_would_help
from lightning_mgpu.whatif.links import (
    PRESETS,
    Link,
    link_from_bench_comm,
    link_from_gbps,
    link_from_profile,
    refuse_one_host_sweep,
    resolve_link,
)
from lightning_mgpu.whatif.model import Prediction, Scenario, System, predict, sweep_world_sizes
from lightning_mgpu.whatif.records import Gradient, ProfileError, ProfiledRun, load_profile

__all__ = [
    "COMPRESSIONS",
    "PRESETS",
    "Advice",
    "CompressionCosts",
    "Gradient",
    "Lever",
    "Link",
    "Prediction",
    "ProfileError",
    "ProfiledRun",
    "Scenario",
    "System",
    "link_from_bench_comm",
    "link_from_gbps",
    "link_from_profile",
    "load_profile",
    "predict",
    "rank_levers",
    "refuse_one_host_sweep",
    "resolve_link",
    "sweep_world_sizes",
    "what_would_help",
]
