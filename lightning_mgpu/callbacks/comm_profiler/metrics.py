"""Every metric key ``CommProfiler`` logs and what it means: the one list that the callback's
docstring table (checked by a test) and the docs are made from.

Values are medians over the profiled steps since the last log, gathered from every rank;
"slowest rank" means the largest of the ranks' medians. No imports: a docs generator can
read this module alone.
"""

from __future__ import annotations

import re
import textwrap

METRICS: dict[str, str] = {
    "comm/step_ms": "a synchronising training step, start to end (slowest rank)",
    "comm/forward_ms": "forward pass and loss (slowest rank)",
    "comm/backward_compute_ms": "backward until the last gradient was ready (slowest rank)",
    "comm/comm_ms": "first bucket launched -> last bucket done (slowest rank)",
    "comm/exposed_ms": "communication after backward compute ended: time the step waited for the network "
    "(slowest rank)",
    "comm/overlap_ratio": "share of ``comm_ms`` hidden behind backward compute (0..1)",
    "comm/optimizer_ms": "the optimizer's ``step()``, to the end of the batch (slowest rank)",
    "comm/optimizer_step_ms": "the whole optimizer step: with gradient accumulation every micro-batch of the "
    "window (``step_ms`` plus those that do not communicate), else ``step_ms`` (slowest rank)",
    "comm/bytes_per_step": "gradient bytes reduced per step",
    "comm/wire_bytes_per_step": "bytes actually sent per step (after fp16/bf16 casting)",
    "comm/compression_ratio": "``bytes_per_step / wire_bytes_per_step`` (when known)",
    "comm/algbw_gbps": "``wire bytes / comm_ms`` in GB/s (1e9 B/s)",
    "comm/busbw_gbps": "``algbw * 2(n-1)/n``: nccl-tests' bus bandwidth of all-reduce",
    "comm/busbw_fraction": "``busbw`` / the machine's peak from ``lightning-mgpu bench-comm`` (when ``sweep=`` is given)",
    "comm/straggler_ms": "slowest minus fastest rank's median compute (forward + backward compute): how long "
    "the others wait for the slowest",
}
"""Logged key -> meaning (reStructuredText), in the order of the docstring table."""

OPTIONAL_METRICS = frozenset({"comm/compression_ratio", "comm/busbw_fraction"})
"""Keys logged only when their figure is known: a fixed wire ratio (not PowerSGD), a ``sweep=`` result."""

_KEY_WIDTH = 30
_MEANING_WIDTH = 62
_NBSP = "\u00a0"


def metrics_table() -> str:
    """:data:`METRICS` as the reStructuredText simple table of ``CommProfiler``'s docstring."""
    rule = f"{'=' * _KEY_WIDTH}  {'=' * _MEANING_WIDTH}"
    lines = [rule, f"{'key':<{_KEY_WIDTH}}  meaning", rule]
    for key, meaning in METRICS.items():
        # an inline literal stays on one line: its spaces are non-breaking while wrapping
        atomic = re.sub(r"``.*?``", lambda m: m.group(0).replace(" ", _NBSP), meaning)
        wrapped = [
            line.replace(_NBSP, " ")
            for line in textwrap.wrap(atomic, _MEANING_WIDTH, break_long_words=False, break_on_hyphens=False)
        ]
        lines.append(f"{f'``{key}``':<{_KEY_WIDTH}}  {wrapped[0]}")
        lines.extend(f"{'':<{_KEY_WIDTH}}  {line}" for line in wrapped[1:])
    lines.append(rule)
    return "\n".join(lines)
