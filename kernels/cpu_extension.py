"""kvmesh's compiled CPU kernels (``csrc/``): build once, load, or fall back to the torch path.

- ``paged_decode`` (``csrc/paged_decode_cpu.cpp``): gathering scattered blocks into a contiguous tensor
  costs a CPU as much as the attention that follows, so decode rows (one query each, the bulk of every
  step) go through a small C++ kernel that reads the paged cache in place.
- ``paged_prefill`` (``csrc/paged_prefill_cpu.cpp``): prefill and extend rows, causal, read in place too:
  tiles of query positions under one KV head (its whole GQA group) with flash attention's online softmax.
- ``sample_rows`` and ``argmax_rows`` (``csrc/sample_cpu.cpp``): the sampler's rejection path
  (``replica/sampler.py``) fused, a few passes over each row of logits instead of a dozen torch kernels
  with temporaries, and a greedy argmax several times faster than torch's on long rows.
- ``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary`` (``csrc/layers_cpu.cpp``): the model's
  elementwise layers in one pass each (``kernels/layers.py``).
- ``linear_rows`` (``csrc/linear_cpu.cpp``): a prepacked linear layer with its rows shared out between
  threads, one single-threaded oneDNN call each, for the shapes where that beats oneDNN's own threading
  (``kernels/cpu_linear.py`` measures which).
- ``pack_panels`` and ``linear_panels`` (``csrc/panel_linear_cpu.cpp``): float32 linear layers for decode-sized
  batches on weights packed in 32-column panels, the next panel prefetched while one computes: a decode
  step streams every weight from memory, which oneDNN's GEMM leaves unhidden.
- ``lora_update`` (``csrc/lora_cpu.cpp``): a step's LoRA updates of one projection, every adapter's tokens
  in one call (``kernels/lora.py``).

All of them compute in float and widen and round half-precision values through ``csrc/convert.h`` (c10's
rounding, in a form the compiler vectorizes: with c10's own operators bf16 SiLU-and-mul ran 8x slower).

torch's extension builder compiles them on first use (about 30 s on two cores) into
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and later processes load the cached
library; concurrent replicas wait on the builder's lock instead of compiling twice. It is built for the
CPU it runs on (``-march=native``), so the build folder is named after the CPU's feature flags: a cache
copied to another machine is rebuilt, never executed with missing instructions. The name also covers the
sources' folder: two checkouts on one machine would otherwise rebuild one folder in turn (its build file
names the sources' paths). A builder killed mid-build leaves its lock behind, on which every later process
would wait forever: a lock older than ``STALE_LOCK_S`` is removed with a warning.

Without a C++ compiler or ninja, or with ``KVMESH_CPU_KERNELS=0``, the torch paths serve instead (the
gather path of ``torch_attention.py``, the torch sampler): slower, same results; the reason is logged once.
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / f"{name}_cpu.cpp"
    for name in ("paged_decode", "paged_prefill", "sample", "layers", "linear", "panel_linear", "int4_quant", "lora")
]
HEADERS = [CSRC / "paged_cache.h", CSRC / "convert.h"]
ENV_SWITCH = "KVMESH_CPU_KERNELS"
STALE_LOCK_S = 900.0
"""A build lock this old is a dead builder's (a build takes well under a minute to a few minutes)."""
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
def _load() -> bool:
    """Build (or find built) and load the extension; False where it cannot be (the torch paths serve)."""
    if os.environ.get(ENV_SWITCH, "1").strip() in ("0", "false", "no", "off"):
        return False
    from torch.utils import cpp_extension

    sources = b"".join(p.read_bytes() for p in SOURCES + HEADERS) + str(CSRC.resolve()).encode()
    name = f"kvmesh_cpu_{_cpu_fingerprint()}_{hashlib.sha256(sources).hexdigest()[:8]}"
    _drop_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
    cflags, ldflags = _flags()
    start = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported flags: serve anyway, slower
        log.warning("CPU kernels unavailable (%s); using the torch paths", str(exc).splitlines()[0])
        return False
    log.info("CPU kernels %s ready in %.1f s", name, time.perf_counter() - start)
    return True


def _drop_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def build_cpu_kernels() -> bool:
    """Build (or find built) and load the kernels now, as a node's preparation does; False where they cannot be."""
    return _load()


def cpu_op(name: str) -> Callable | None:
    """``torch.ops.kvmesh_cpu.<name>`` once the extension is built and loaded, or None (the caller's torch
    path serves)."""
    return getattr(torch.ops.kvmesh_cpu, name) if _load() else None
