"""Where an unmodified model can be cut: candidate split points, the chosen ones, and which device each module goes to.

* :func:`candidate_blocks`: without ``split_points``, the cuts are taken among the children
  of the model's largest ``nn.ModuleList``/``nn.Sequential`` of repeated blocks (GPT-2's
  ``transformer.h``, a ResNet's blocks), else among the top-level children.
* :func:`check_split_points`: given names exist, are distinct, and none contains another.
* :func:`points_from_sizes`: a plan's stage sizes over the candidates, as split points (the
  candidate where each stage after the first begins).
* :func:`recompute_units`: the modules whose forwards activation checkpointing runs again: the
  split points, and the candidate blocks that hold none.
* :func:`stage_of_modules`: the stage each module belongs to, in definition order (the
  module where a split point begins and everything defined after it, up to the next).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Optional

from torch import nn

__all__ = ["candidate_blocks", "check_split_points", "points_from_sizes", "recompute_units", "stage_of_modules"]


def candidate_blocks(root: nn.Module, *, minimum: int = 2) -> list[str]:
    """Qualified names of the children of ``root``'s largest container of repeated blocks (see the module docstring)."""
    best: Optional[tuple[tuple[int, int, int], str, nn.Module]] = None
    for name, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < minimum:
            continue
        children = list(module.children())
        kinds = {type(child) for child in children}
        repeated = len(kinds) == 1
        params = sum(p.numel() for p in module.parameters())
        score = (int(repeated), len(children), params)
        if best is None or score > best[0]:
            best = (score, name, module)
    if best is not None:
        _, prefix, top = best
    else:
        top = root
        while len(list(top.children())) == 1:  # a wrapper (e.g. self.model): look inside
            top = next(iter(top.children()))
        prefix = {id(module): name for name, module in root.named_modules()}[id(top)]
    return [f"{prefix}.{child}" if prefix else child for child, _ in top.named_children()]


def check_split_points(root: nn.Module, split_points: Sequence[str], num_stages: int) -> list[str]:
    """``split_points`` checked against ``root``: K - 1 distinct names of submodules, none inside another."""
    points = list(split_points)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"split_points={points!r} makes {len(points) + 1} stage(s) but devices_per_replica={num_stages}: "
            f"give {num_stages - 1} name(s), the submodules where stages 1..{num_stages - 1} begin"
        )
    if len(set(points)) != len(points):
        raise ValueError(f"split_points={points!r} names a submodule twice: each must begin its own stage")
    names = dict(root.named_modules())
    for point in points:
        if point not in names:
            close = [name for name in names if name.endswith("." + point.rsplit(".", 1)[-1])][:3]
            hint = f" Did you mean one of {close}?" if close else ""
            raise ValueError(
                f"split point {point!r} is not a submodule of {type(root).__name__}: give qualified names relative "
                f"to the LightningModule, as named_modules() lists them (e.g. 'model.transformer.h.2').{hint}"
            )
        if point == "":
            raise ValueError("split point '' is the whole model: name a submodule where a stage begins")
    for a in points:
        for b in points:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"split points {a!r} and {b!r}: one is inside the other; a stage begins at one module")
    return points


def points_from_sizes(candidates: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """The candidate at which each stage after the first begins, for ``sizes`` candidates per stage."""
    return [candidates[start] for start in accumulate(sizes[:-1])]


def recompute_units(root: nn.Module, split_points: Sequence[str]) -> list[str]:
    """The split points and the candidate blocks (:func:`candidate_blocks`) that contain none, outermost only, in
    definition order: what activation checkpointing recomputes (only their inputs are kept)."""
    names = [*split_points, *candidate_blocks(root)]

    def inside(name: str, other: str) -> bool:
        return name.startswith(other + ".")

    units = {name for name in names if not any(inside(point, name) for point in split_points)}
    units = {name for name in units if not any(inside(name, other) for other in units)}
    return [name for name, _ in root.named_modules() if name in units]


def stage_of_modules(root: nn.Module, split_points: Sequence[str]) -> dict[str, int]:
    """Each module's stage by definition order: a split point's module and what follows it belong to its stage."""
    starts = {name: stage + 1 for stage, name in enumerate(split_points)}
    stage = 0
    out: dict[str, int] = {}
    for name, _ in root.named_modules():
        for point, begins in starts.items():
            if name == point or name.startswith(point + "."):
                stage = max(stage, begins)
        out[name] = stage
    return out
