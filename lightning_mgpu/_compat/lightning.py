"""Private Lightning names, each behind a function of ours with a version guard (see ``_compat``).

Append new shims at the end as self-contained blocks: a ``guarded(...)`` declaration,
then the public function that uses it (with its fallback or a clear error).
"""

from __future__ import annotations

from lightning_mgpu._compat import guarded  # noqa: F401
