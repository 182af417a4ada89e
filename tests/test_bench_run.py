"""``kvmesh bench run`` end to end on the tiny model: one router, a short multi-turn chat, real counters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.process_helpers import outlived

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_bench_run_reports_routers_side_by_side(tiny_llama_dir, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cluster.launch.cli",
        "bench",
        "run",
        "--model",
        str(tiny_llama_dir),
        "--routers",
        "kv_aware,round_robin",
        "--replicas",
        "2",
        "--sessions",
        "3",
        "--turns",
        "3",
        "--rate",
        "4",
        "--warmup",
        "1",
        "--max-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        str(out),
        "--png",
        str(tmp_path / "bench.png"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "router" in proc.stdout and "kv_aware" in proc.stdout and "round_robin" in proc.stdout
    result = json.loads(out.read_text())
    assert 0 < result["pooled_bound"] <= 1
    for name in ("kv_aware", "round_robin"):
        run = result["routers"][name]
        assert run["errors"] == 0 and run["requests"] == 9
        assert run["ttft_p50_s"] > 0 and run["output_tok_s"] > 0
        assert sum(run["requests_per_replica"].values()) == 9  # every request counted by a replica
        assert run["hit_rate"] <= result["pooled_bound"] + 1e-9  # nobody beats one cache as large as all
    # later turns reuse their history: KV-aware routing keeps conversations where their blocks are
    assert result["routers"]["kv_aware"]["hit_rate"] > 0.3


def test_a_benchmark_killed_mid_run_leaves_no_cluster_behind(tiny_llama_dir):
    """``kvmesh bench run`` killed outright (SIGKILL: a CI timeout) while its cluster runs: the ``kvmesh serve``
    it started hears of it and stops Ray and Redis, instead of leaving them (and their engines) running."""
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "bench", "run", "--model", str(tiny_llama_dir)]
    cmd += ["--routers", "kv_aware", "--replicas", "1", "--sessions", "50", "--turns", "4", "--threads", "1"]
    bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not {"raylet", "redis-server"} <= set(started.values()):
            for child in psutil.Process(bench.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    started[child.pid] = child.name()
            time.sleep(0.5)
        assert {"raylet", "redis-server"} <= set(started.values()), f"no cluster came up: {started}"
    finally:
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait()
    left = outlived(started, 90)
    assert not left, f"left running after the benchmark was killed: {left}"
