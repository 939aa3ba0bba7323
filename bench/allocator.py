"""Process-wide C allocator tuning for CPU pipeline benchmarks (glibc's ``mallopt``).

It lives in ``bench/`` and not in the package on purpose: it changes the allocator of the
whole process, which a library must not do behind its user's back. A CPU user of the
hybrid strategy who wants it sets ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
in the environment (the same thing) or calls this from their own script.
"""

from __future__ import annotations

import ctypes

__all__ = ["retain_freed_memory"]

# glibc's <malloc.h> parameter numbers for mallopt().
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 2**30) -> bool:
    """Ask glibc to keep freed CPU memory for reuse instead of returning it to the OS.

    Micro-batching on CPU allocates and frees large tensors once per micro-batch (boundary
    activations, and the weight gradients of layers other than plain ``nn.Linear``); with
    glibc's defaults a large freed block goes back to the OS and the next allocation
    page-faults it in again (thousands of faults per step, ``bench/pipeline.py`` counts
    them). This sets ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` with ``mallopt`` — the
    same as starting Python with
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment — for the
    whole process: the resident size then stays near its peak. Returns ``False`` where it
    cannot apply (not glibc). GPU memory is unaffected (CUDA has its own caching allocator).
    """
    try:
        # The C library this process already runs on (no ``find_library``: it starts ldconfig).
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no mallopt (not glibc), or no dlopen(NULL) (Windows)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    )
