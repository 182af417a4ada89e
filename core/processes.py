"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when the thread that started it ends."""


def die_with_parent() -> None:
    """In a child between fork and exec (``preexec_fn``): SIGTERM it when its parent dies, even by SIGKILL, so
    a server it runs stops cleanly instead of living on as an orphan. Linux only; elsewhere nothing. Start
    such children from a thread that lives as long as they should (the main thread)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
