"""Bucket-size search for ``TunedDDPStrategy(bucket_cap_mb="auto")`` and ``lightning-mgpu tune``.

* :mod:`~lightning_mgpu.tuning.layout`: the bucket layout a size gives, predicted from the
  gradient-ready order, and one candidate per distinct layout;
* :mod:`~lightning_mgpu.tuning.plan`: which steps measure which candidate (interleaved rounds);
* :mod:`~lightning_mgpu.tuning.statistics`: distribution-free ratio intervals and spread of step times;
* :mod:`~lightning_mgpu.tuning.decision`: medians of the slowest rank's step times, the choice (faster
  with confidence, not faster, or too noisy to decide);
* :mod:`~lightning_mgpu.tuning.tuner`: the state machine the strategy drives during ``fit``.

The offline sweep behind ``lightning-mgpu tune`` is :mod:`lightning_mgpu.cli.workers.tune` (it drives a
strategy, so it sits above this package).
"""

from lightning_mgpu.tuning.decision import CandidateResult
from lightning_mgpu.tuning.buckets import DEFAULT_GRID_MB
from lightning_mgpu.tuning.layout import Candidate, distinct_candidates, predict_buckets
from lightning_mgpu.tuning.plan import TuningSettings

__all__ = [
    "DEFAULT_GRID_MB",
    "Candidate",
    "CandidateResult",
    "TuningSettings",
    "distinct_candidates",
    "predict_buckets",
]
