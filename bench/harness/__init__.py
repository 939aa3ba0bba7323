"""The one harness every benchmark stands on.

* :mod:`~bench.harness.launch`: start N ranks (``torch.distributed.run`` here, or one per node
  of a lab), with timeouts, and read rank 0's report back or stop with the output's tail;
* :mod:`~bench.harness.interleave`: configurations over rounds in an order that changes each
  round (the package's rule), so a drifting machine favours none; the rounds of separate launches;
* :mod:`~bench.harness.stats`: the package's statistics (one median, one p90, ...), paired
  ratios and a distribution-free interval of the median;
* :mod:`~bench.harness.worker`: what a launched rank runs around its fits (clock, Trainer, the end);
* :mod:`~bench.harness.cli` and :mod:`~bench.harness.report`: the shared options (``--quick``,
  ``--out``, the launch's), machine facts, the JSON report and the table.

A benchmark script is then its configurations and its table.
"""
