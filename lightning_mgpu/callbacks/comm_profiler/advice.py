"""CommProfiler's "what would help" block: the ``whatif=`` option, the gradients the replay needs,
the block itself and its W&B rows.

At the end of a profiled fit rank 0 replays the profile (:func:`~lightning_mgpu.whatif.what_would_help`,
pure Python, a few dozen simulated steps) and adds the levers it ranks to the console summary,
to ``comm_profile.json`` (``"what_would_help"``) and, with a ``WandbLogger``, to W&B. Nothing
here may fail a fit that trained: :func:`advise` turns any failure into a one-line block.

For exact re-bucketing (and PowerSGD in ``lightning-mgpu whatif``) the profile lists each
bucket's gradients (``"params"``: name, shape, dtype in DDP's order), taken from the layout DDP
built, which a strategy offers as its public ``bucket_layout`` (``ddp_tuned``, ``hybrid``; read
by name, as callbacks never import a strategy), only when its buckets hold the bytes the
profiler recorded for them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence, Union

import torch

from lightning_mgpu._checks import check_real
from lightning_mgpu.whatif.levers import Advice, what_would_help
from lightning_mgpu.whatif.links import PRESETS, Link, resolve_link
from lightning_mgpu.whatif.records import DTYPE_BYTES

WhatIf = Union[bool, str, float, Link]
"""The ``whatif=`` option once checked: False (off), True (the profiled system), a link preset
name, a payload rate in Gbit/s, or a :class:`~lightning_mgpu.whatif.Link`."""


def check_whatif(value: object) -> WhatIf:
    """``CommProfiler(whatif=...)`` checked and normalised (``None`` -> False); ValueError otherwise."""
    if value is None or value is False:
        return False
    if value is True or isinstance(value, Link):
        return value
    if isinstance(value, str):
        try:
            resolve_link(value)
        except ValueError:
            raise ValueError(
                f"CommProfiler: whatif must be True, False, a link preset ({', '.join(PRESETS)}) or a rate in "
                f"Gbit/s, got {value!r:.60}"
            ) from None
        return value.strip().lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_real("whatif", value, above=0, owner="CommProfiler", what="a link rate in Gbit/s")
    raise ValueError(
        "CommProfiler: whatif must be True, False/None, a link preset name (e.g. '10gbe') or a rate in Gbit/s "
        f"(e.g. 2.5), got {value!r:.60} ({type(value).__name__})"
    )


# ------------------------------------------------------------------ the gradients of each bucket


class LayoutBucket(Protocol):
    """One bucket of a strategy's ``bucket_layout`` (``lightning_mgpu.strategies.BucketInfo``)."""

    @property
    def bytes(self) -> int: ...

    @property
    def num_params(self) -> int: ...

    @property
    def param_names(self) -> Sequence[str]: ...


def bucket_gradients(
    layout: Optional[Sequence[LayoutBucket]],
    parameters: Mapping[str, torch.Tensor],
    buckets: Sequence[Mapping[str, Any]],
) -> Optional[list[list[dict[str, Any]]]]:
    """Each recorded bucket's gradients (``{"name", "shape", "dtype"}`` in DDP's order), or None
    when the layout does not describe the buckets the profiler recorded: another number of
    buckets, another byte count or parameter count in any of them, a parameter not found by
    name, or a dtype the replay model does not know."""
    if not layout or len(layout) != len(buckets):
        return None
    out: list[list[dict[str, Any]]] = []
    for info, recorded in zip(layout, buckets):
        if info.bytes != recorded.get("bytes") or info.num_params != recorded.get("num_params", info.num_params):
            return None
        entries, total = [], 0
        for name in info.param_names:
            param = parameters.get(name)
            dtype = str(param.dtype).removeprefix("torch.") if param is not None else ""
            if param is None or dtype not in DTYPE_BYTES:
                return None
            total += param.numel() * param.element_size()
            entries.append({"name": name, "shape": list(param.shape), "dtype": dtype})
        if total != info.bytes:
            return None
        out.append(entries)
    return out


def add_bucket_gradients(profile: dict[str, Any], strategy: Any) -> bool:
    """Give each bucket of ``profile`` its ``"params"`` (see :func:`bucket_gradients`); True if it
    did. Never raises: without them the replay approximates, and says so."""
    try:
        model = getattr(strategy, "model", None)
        module = getattr(model, "module", model)
        if not isinstance(module, torch.nn.Module) or not profile["buckets"]:
            return False
        layout = getattr(strategy, "bucket_layout", None)  # None: stock DDP, or DDP not yet rebuilt
        gradients = bucket_gradients(layout, dict(module.named_parameters()), profile["buckets"])
    except Exception:
        return False
    if gradients is None:
        return False
    for bucket, params in zip(profile["buckets"], gradients):
        bucket["params"] = params
    return True


# ------------------------------------------------------------------ the block


def advise(profile: Mapping[str, Any], whatif: WhatIf) -> Advice:
    """What would help, on the profiled system (``whatif=True``) or over the named link (one node
    per profiled rank; two for a one-rank profile: what a second node over that link would do).
    Never raises: a failure is a block of one line saying what went wrong."""
    try:
        if isinstance(whatif, bool):
            return what_would_help(profile)
        nodes = 2 if profile.get("world_size") == 1 else None
        return what_would_help(profile, link=whatif, nodes=nodes)
    except Exception as error:  # a bug in the replay must not fail a fit that trained
        return Advice("what would help: not available", (), (f"{type(error).__name__}: {error}",))


def block_lines(advice: Advice) -> list[str]:
    """The lines printed after the summary: the levers, or a single line when there are none."""
    if advice.levers:
        return advice.lines
    notes = "; ".join(advice.notes)
    return [f"{advice.title} ({notes})" if notes else advice.title]


ADVICE_COLUMNS = ("lever", "saves_pct", "step_ms", "note")
"""Columns of the W&B table ``comm/what_would_help``."""


def advice_rows(advice: Mapping[str, Any]) -> list[list[Any]]:
    """``Advice.as_dict()`` as rows of :data:`ADVICE_COLUMNS`: the scenario (its title), each
    lever (its sentence as the note), then the notes."""
    rows: list[list[Any]] = [["scenario", None, None, advice.get("title", "")]]
    for lever in advice.get("levers", ()):
        rows.append([lever["name"], lever["saving_pct"], lever["step_ms"], lever["sentence"]])
    rows.extend(["note", None, None, note] for note in advice.get("notes", ()))
    return rows
