"""Where each layer runs: a model split into pipeline stages, planned (``planning/``) and run (``running/``).

Two layers, each importing only the one below it: :mod:`.planning` decides the split before
anything runs (the exact planner, schedules, the one profiler, split points, the plan), and
:mod:`.running` is the one pipeline engine that runs it under any schedule. The hybrid strategy
calls them through one facade, :mod:`.runner`. ``partition`` is pure algorithm on plain lists of
numbers (no torch import here, so the planner can run anywhere, e.g. in ``lightning-mgpu plan``
before any device is touched).
"""

from typing import TYPE_CHECKING, Any

from lightning_mgpu.placement.planning.partition import partition

if TYPE_CHECKING:  # what __getattr__ loads, for type checkers
    from lightning_mgpu.placement.planning.plan import PlacementPlan, make_plan, plan_stages
    from lightning_mgpu.placement.planning.profile import LayerCost, profile_layers

__all__ = ["LayerCost", "PlacementPlan", "make_plan", "partition", "plan_stages", "profile_layers"]


def __getattr__(name: str) -> Any:  # the torch-dependent parts load on first use
    if name in ("LayerCost", "profile_layers"):
        from lightning_mgpu.placement.planning import profile

        return getattr(profile, name)
    if name in ("PlacementPlan", "plan_stages", "make_plan"):  # make_plan: deprecated name of plan_stages
        from lightning_mgpu.placement.planning import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'lightning_mgpu.placement' has no attribute {name!r}")
