"""Where each layer runs: splitting a sequential model into pipeline stages.

``partition`` is pure algorithm on plain lists of numbers (no torch import here, so the
planner can run anywhere, e.g. in ``lightning-mgpu plan`` before any device is touched).
"""

from lightning_mgpu.placement.partition import partition

__all__ = ["LayerCost", "PlacementPlan", "make_plan", "partition", "plan_stages", "profile_layers"]


def __getattr__(name: str):  # the torch-dependent parts load on first use
    if name in ("LayerCost", "profile_layers"):
        from lightning_mgpu.placement import profile

        return getattr(profile, name)
    if name in ("PlacementPlan", "plan_stages", "make_plan"):  # make_plan: deprecated name of plan_stages
        from lightning_mgpu.placement import plan

        return getattr(plan, name)
    raise AttributeError(f"module 'lightning_mgpu.placement' has no attribute {name!r}")
