"""``CommProfiler``: where a DDP step's time goes — compute, communication, and how much of it hides behind backward.

One job per module; imports go downwards in this list:

- :mod:`.callback`: the Lightning hooks (schedule the profiling windows, stamp, feed, gather, log);
- :mod:`.report`: the outputs (console summary, ``comm_profile.json``, CSV, Chrome trace, PNG timeline, W&B);
- :mod:`.advice`: the "what would help" block (``whatif=``: the profile replayed by :mod:`lightning_mgpu.whatif`);
- :mod:`.stats`: the arithmetic (medians, slowest rank, bandwidth, buckets, the profile document), pure;
- :mod:`.schedule`: which synchronising steps are profiled, pure;
- :mod:`.metrics`: every logged key and its meaning (:data:`METRICS`).
"""

from lightning_mgpu.callbacks.comm_profiler.callback import CommProfiler
from lightning_mgpu.callbacks.comm_profiler.metrics import METRICS
from lightning_mgpu.callbacks.comm_profiler.schedule import ProfileSchedule
from lightning_mgpu.callbacks.comm_profiler.stats import CommStats

__all__ = ["METRICS", "CommProfiler", "CommStats", "ProfileSchedule"]
