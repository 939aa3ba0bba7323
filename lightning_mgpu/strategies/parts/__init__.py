"""The strategies' parts, one job per module, composed by ``TunedDDPStrategy`` (and through it ``hybrid``):
argument checks (``options``, ``hybrid_options``), launchers, the rendezvous (``process_group``), the DDP
wrapper and its hook chain (``ddp_model``), the bucket-size search in a fit (``auto_buckets``), the package's
checkpoint state (``checkpoint_state``), and the fit's reliability (``reliability``: ``preemption``,
``checkpoint_io``, ``failures``)."""
