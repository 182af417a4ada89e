"""The compiled CPU decode-attention kernel (``csrc/paged_decode_cpu.cpp``): build once, load, or fall back.

Gathering scattered blocks into a contiguous tensor costs a CPU as much as the attention that follows, so
decode rows (one query each, the bulk of every step) go through a small C++ kernel that reads the paged
cache in place. torch's extension builder compiles it on first use (a few seconds) into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and later processes load the cached
library; concurrent replicas wait on the builder's lock instead of compiling twice. It is built for the
CPU it runs on (``-march=native``), so the build folder is named after the CPU's feature flags: a cache
copied to another machine is rebuilt, never executed with missing instructions.

Without a C++ compiler or ninja, or with ``KVMESH_CPU_DECODE_KERNEL=0``, the pure-torch gather path in
``torch_attention.py`` serves instead (slower, same results); the reason is logged once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
ENV_SWITCH = "KVMESH_CPU_DECODE_KERNEL"
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _cpu_fingerprint() -> str:
    """A short digest of the CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        info = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), text[:2000])
    except OSError:
        info = platform.processor() or platform.machine()
    return hashlib.sha256(info.encode()).hexdigest()[:10]


def _flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags: OpenMP threads (torch's parallel_for), native ISA, vectorized ``expf``."""
    cflags, ldflags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"], ["-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        cflags.append("-mprefer-vector-width=512")  # AVX-512 where the CPU has it (~10% faster here); else moot
        ldflags.append("-lmvec")  # glibc's vector math library: the softmax's exp, 8 or 16 lanes at a time
    return cflags, ldflags


@functools.cache
def paged_decode_kernel() -> Callable | None:
    """``torch.ops.kvmesh_cpu.paged_decode`` once built and loaded, or None (the torch path serves)."""
    if os.environ.get(ENV_SWITCH, "1").strip() in ("0", "false", "no", "off"):
        return None
    from torch.utils import cpp_extension

    name = f"kvmesh_cpu_decode_{_cpu_fingerprint()}"
    cflags, ldflags = _flags()
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=name, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags, is_python_module=False
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: serve anyway, slower
        log.warning("CPU decode kernel unavailable (%s); using the torch gather path", str(exc).splitlines()[0])
        return None
    log.info("CPU decode kernel %s ready in %.1f s", name, time.perf_counter() - start)
    return torch.ops.kvmesh_cpu.paged_decode
