"""``kvmesh serve`` as a child process on free loopback ports: start, wait until ready, stop with SIGTERM.

Used by the benchmarks and the end-to-end tests. Every process the server starts is remembered while it
runs, so a caller can check that a shutdown left nothing behind, or kill exactly those processes (by id)
after a failure. On Linux the server is also sent SIGTERM when the process that started it dies, however it
dies (a benchmark killed by a timeout), so it shuts its Ray cluster and Redis down instead of leaving them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from kvmesh.cluster.launch.config import PROBE_DEADLINE_ENV, PROBE_DEADLINE_S
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.processes import die_with_parent


class ServeProcess:
    PORT_RETRIES = 2
    """Relaunches, on fresh ports, when a port picked free was taken before the server bound it (Ray's own
    processes start in between and bind ports of their choosing)."""

    def __init__(self, args: list[str], log: Path | None = None) -> None:
        self.args = args
        self.log = log or Path(tempfile.mkstemp(prefix="kvmesh-serve-", suffix=".log")[1])
        self.descendants: set[int] = set()
        self._launch()

    def _launch(self) -> None:
        self.http, self.grpc = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        # Always a cluster of its own, with its own embedded Redis.
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "KVMESH_REDIS_URL")}
        env.setdefault(PROBE_DEADLINE_ENV, PROBE_DEADLINE_S)
        cmd = [
            sys.executable,
            "-m",
            "kvmesh.cluster.launch.cli",
            "serve",
            "--port",
            str(self.http),
            "--grpc-port",
            str(self.grpc),
        ]
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            [*cmd, *self.args],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text()[-n:]

    def wait_ready(self, timeout_s: float = 300) -> float:
        """Seconds from launch until the server printed that it is ready."""
        deadline = time.monotonic() + timeout_s
        retries = self.PORT_RETRIES
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries and "Failed to bind to address" in self.log.read_text():
                    retries -= 1
                    print(f"port {self.http} or {self.grpc} was taken meanwhile: relaunching", file=sys.stderr)
                    self._launch()
                    continue
                raise RuntimeError(f"kvmesh serve exited with {self.proc.returncode}:\n{self.tail()}")
            self.remember_processes()
            if "kvmesh is ready" in self.log.read_text():
                return time.perf_counter() - self.started_at
            time.sleep(0.25)
        raise TimeoutError(f"kvmesh serve not ready in {timeout_s} s:\n{self.tail()}")

    def remember_processes(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}

    def alive_descendants(self) -> list[str]:
        alive = []
        for pid in self.descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        return alive

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM, as a user's Ctrl-C or Kubernetes would; returns the exit code."""
        self.remember_processes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill_everything(self) -> None:
        """After a failure: kill the server and every process it started, by the ids recorded."""
        self.remember_processes()
        for pid in [self.proc.pid, *self.descendants]:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        if self.proc.poll() is None or self.alive_descendants():
            self.kill_everything()
