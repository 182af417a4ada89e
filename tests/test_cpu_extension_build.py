"""The CPU kernels' build: a lock left by a builder that died is removed, a live builder's is kept."""

from __future__ import annotations

import os
import time

from kvmesh.kernels.cpu_extension import STALE_LOCK_S, _drop_stale_lock


def test_a_dead_builders_lock_is_removed_a_live_ones_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    _drop_stale_lock(lock)
    assert lock.exists()  # a build may be under way: wait on it
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    _drop_stale_lock(lock)
    assert not lock.exists()
    _drop_stale_lock(lock)  # none: nothing to do
