"""``params-diverged``: parameters (or buffers DDP does not broadcast) that differ across ranks.

Compared by exact checksums of their bit patterns (:func:`~..probes.bitsum`); when a parameter
got no gradient under ``find_unused_parameters=False`` (``unused-parameters``), the finding puts the
divergence down to it: DDP never all-reduced that parameter's bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import lightning as L

from lightning_mgpu.callbacks.doctor.findings import Finding, name_list, rank_list
from lightning_mgpu.callbacks.doctor.rule import Check, CheckKind, Rule, Watch
from lightning_mgpu.callbacks.doctor.rules import parameter_use

RULE = Rule(
    "params-diverged",
    catches="parameters that differ across ranks (rank-dependent code, in-place edits, weights loaded on one "
    "rank, buffers not broadcast; or a DDP bucket never all-reduced because a parameter in it got no gradient "
    "under find_unused_parameters=False: then the finding says so and gives unused-parameters' fix)",
    detection="per tensor, an exact checksum of the bit patterns (integer sum, wrapping) of every parameter "
    "(and buffer, when DDP does not broadcast them), compared across ranks after the first step and every "
    "check_every_n_batches",
    cost="one read of the parameters per check (about 1 ms per 10M parameters on a CPU core)",
    fix="change parameters only through the optimizer, the same way on every rank; load weights on every rank "
    "before DDP wraps the model; keep DDP's broadcast_buffers=True or use SyncBatchNorm",
    severity="wrong",
)


def check_params(
    bitsums: Sequence[Sequence[int]], names: Sequence[str], buffers_checked: bool, unreduced: Sequence[str] = ()
) -> Optional[Finding]:
    """``bitsums[r][i]``: the exact bit-pattern checksum of tensor ``names[i]`` on rank ``r``
    (see ``DistributedDoctor``): equal for bitwise-equal tensors, different for any change.
    ``unreduced``: parameters that got no gradient under ``find_unused_parameters=False``; DDP then did
    not all-reduce their buckets, which explains the divergence (the finding says so, with that fix)."""
    if len(bitsums) < 2 or any(len(s) != len(names) for s in bitsums):
        return None
    differ: list[str] = []
    ranks: set[int] = set()
    for index, name in enumerate(names):
        bad = [r for r in range(1, len(bitsums)) if bitsums[r][index] != bitsums[0][index]]
        if bad:
            differ.append(name)
            ranks.update(bad)
    if not differ:
        return None
    seen = f"{len(differ)} tensor(s) differ between rank 0 and rank(s) {rank_list(sorted(ranks))}: {name_list(differ)}"
    if unreduced:
        # DDP launches a bucket's all-reduce once every parameter in it has its gradient: a parameter that gets
        # none holds its whole bucket back, and at the end of that backward the bucket's gradients stay local.
        return RULE.finding(
            seen=seen + f"; they follow from unused-parameters: {len(unreduced)} parameter(s) got no gradient with "
            f"find_unused_parameters=False ({name_list(list(unreduced))})",
            why="DDP all-reduces a bucket only once every parameter in it has a gradient: the buckets holding "
            "those parameters were never averaged, so every parameter sharing them stepped with its own rank's "
            "gradient, and the replicas drifted apart",
            fix="fix the unused parameters and this goes with them: " + parameter_use.UNUSED.fix,
        )
    kinds = "parameters" + (" and buffers" if buffers_checked else "")
    return RULE.finding(
        seen=seen,
        why=f"DDP keeps replicas identical only if every change goes through the averaged gradients; {kinds} that "
        "drifted stay apart for the rest of the run (each rank trains a different model, the checkpoint keeps "
        "rank 0's)",
    )


class ParamsDiverged(Watch):
    """Sends every parameter's checksum at periodic checks and the end of training."""

    rules = (RULE,)
    needs_replicas = True

    def reset(self) -> None:
        super().reset()
        self.unreduced: list[str] = []
        """Parameters without a gradient on some rank under find_unused_parameters=False this fit (so far):
        DDP did not all-reduce their buckets, and the parameters sharing them drift apart."""

    def report(self, trainer: L.Trainer, kind: CheckKind) -> Any:
        watch = self.doctor.parameter_watch
        wanted = self.doctor.enabled(RULE.id) and trainer.world_size > 1 and watch.ddp is not None
        return watch.checksums() if wanted and kind in ("periodic", "train_end") else None

    def judge(self, reports: list[Any], check: Check) -> Iterable[Optional[Finding]]:
        for use in check.of(parameter_use.ParameterUse):
            self.unreduced += [name for name in use.missing_grads if name not in self.unreduced]
        if reports[0] is not None and len(reports) > 1:
            watch = self.doctor.parameter_watch
            sums = [s or [] for s in reports]
            yield check_params(sums, watch.tensor_names, bool(watch.buffer_names), self.unreduced)
