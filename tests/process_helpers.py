"""Checks that processes a test saw start are gone, for tests of what a killed parent leaves behind."""

from __future__ import annotations

import contextlib
import time

import psutil


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def outlived(processes: dict[int, str], timeout_s: float) -> dict[int, str]:
    """Those of ``processes`` (pid -> name) still alive after up to ``timeout_s``; they are then killed, by
    their own ids, so the tests after this one do not run beside them."""
    deadline = time.monotonic() + timeout_s
    left = dict(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: name for pid, name in left.items() if alive(pid)}
    for pid in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    return left
