"""Planning a split: where the stages begin and what each one costs, before anything runs.

The layer of :mod:`lightning_mgpu.placement` that decides: :mod:`.partition` (the exact
planner, pure Python), :mod:`.partition_input` (its input checked), :mod:`.schedule` (which
action each stage runs when, as data, pure Python), :mod:`.profile` (the one profiler: what
each block of a model costs, measured by running the model's own forward),
:mod:`.split_points` (where a model can be cut, and which stage each module is in) and
:mod:`.plan` (``PlacementPlan``, and the planner every rank agrees on). It imports nothing of
the running layer (:mod:`lightning_mgpu.placement.running`), which imports it.
"""
