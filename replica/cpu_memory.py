"""The C allocator tuned for an engine on the CPU: freed activations are reused, not returned to the kernel.

A step allocates and frees megabytes of activations per layer (a 1,024-token prefill of SmolLM2 makes a
12 MB MLP intermediate 30 times). glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and
trims freed memory at the top of the heap, so each such allocation faults every page in again, zeroed by
the kernel: 1.8 million page faults in the 64-prompt SmolLM2 prefill of ``benchmarks/engine_overhead.py``,
0.5 million (loading the model and the KV pool) with the allocator told to keep blocks up to 32 MB in the
heap and to keep up to 1 GiB of freed memory. Only glibc has ``mallopt``; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest allowed mmap threshold on 64-bit systems."""
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Tell the process's allocator to reuse freed blocks (see the module docstring); False where it
    cannot (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        log.debug("mallopt refused the allocator settings; keeping the defaults")
    return ok
