"""Running a split: the one pipeline engine and its parts.

:mod:`.engine` (:class:`~lightning_mgpu.placement.running.engine.Pipeline`: any module, cut
at its split points, run micro-batch by micro-batch under any schedule), :mod:`.worker`
(one thread per stage running its schedule), :mod:`.microbatch` (a batch cut into
micro-batches), :mod:`.handover` (a micro-batch's thread taking turns with the stages, and
what crosses a split point), :mod:`.recompute` (activation checkpointing),
:mod:`.weight_pass` (zero-bubble's split backward), :mod:`.linear_grads` (the ``nn.Linear``
fast path) and :mod:`.shared_params` (a parameter used by stages on different devices).
Imports :mod:`lightning_mgpu.placement.planning` (schedules, split points), never the other way.
"""
