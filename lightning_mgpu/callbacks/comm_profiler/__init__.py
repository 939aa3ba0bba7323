"""``CommProfiler``: where a DDP step's time goes — compute, communication, and how much of it hides behind backward.

One job per module; imports go downwards in this list:

- :mod:`.callback`: the Lightning hooks (schedule the profiling windows, stamp, feed, gather, log);
- :mod:`.report`: the outputs (console summary, ``comm_profile.json``, CSV, Chrome trace, PNG timeline, W&B);
- :mod:`.schedule`: which synchronising steps are profiled (pure).
"""

from lightning_mgpu.callbacks.comm_profiler.callback import CommProfiler

__all__ = ["CommProfiler"]
