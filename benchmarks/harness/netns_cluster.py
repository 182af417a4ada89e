"""A two-node Ray cluster on one machine: each node in a network namespace of its own, for the multi-node
tests and benchmarks.

Each namespace gets one end of a veth pair (198.18.0.1 the head, 198.18.0.2 the worker, a benchmarking
range no real host uses), its own loopback, and no default route: traffic stays between the two. Each
node's processes get their own ``HOME`` (so their caches, model files and compiled kernels, start cold)
and ``RAY_TMPDIR``. Everything here is made with a tag of its own and torn down by it: the processes of
our namespaces (by the ids ``ip netns pids`` lists), then the namespaces (the veth pair goes with them).
Needs root and ``ip``; ``NetnsUnavailable`` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD_IP, WORKER_IP = "198.18.0.1", "198.18.0.2"
GCS_PORT = 6379
WORKER_RESOURCE = "kvmesh_worker"
"""A custom resource only the worker has: engine replicas that ask for it land there."""


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, no permission)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class NetnsCluster:
    """``create()``, ``start_head()``, ``start_worker()``; ``kill_node`` to lose one; ``teardown()`` always."""

    def __init__(self, root: Path, tag: str | None = None, worker_cpus: int = 1, auth_token: str | None = None) -> None:
        self.root = Path(root)
        self.tag = tag or f"{os.getpid() % 100000}"
        self.ns = {"head": f"kvm{self.tag}h", "worker": f"kvm{self.tag}w"}
        self.ips = {"head": HEAD_IP, "worker": WORKER_IP}
        self.worker_cpus = worker_cpus
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token} if auth_token else {}
        """Ray's token authentication for every process on both nodes (and every client of the cluster)."""
        self.made: list[str] = []
        self.ray_tmp = Path(tempfile.mkdtemp(prefix=f"kvm{self.tag}"))
        """Ray's sockets live under its temp dir, whose paths must stay short (108 bytes): not under ``root``."""

    # ------------------------------------------------------------------ namespaces
    def create(self) -> NetnsCluster:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise NetnsUnavailable("network namespaces need root and the `ip` command")
        head, worker = self.ns["head"], self.ns["worker"]
        veth_h, veth_w = f"kvm{self.tag}a", f"kvm{self.tag}b"
        try:
            for ns in (head, worker):
                _ip("netns", "add", ns)
                self.made.append(ns)
            _ip("link", "add", veth_h, "type", "veth", "peer", "name", veth_w)
            _ip("link", "set", veth_h, "netns", head)
            _ip("link", "set", veth_w, "netns", worker)
            for ns, dev, ip in ((head, veth_h, HEAD_IP), (worker, veth_w, WORKER_IP)):
                _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            self.teardown()
            raise NetnsUnavailable(f"could not make network namespaces: {detail}") from None
        for node in self.ns:
            (self.root / node / "home").mkdir(parents=True, exist_ok=True)
            (self.ray_tmp / node).mkdir(parents=True, exist_ok=True)
        return self

    def env(self, node: str, **extra: str) -> dict[str, str]:
        """The environment of a process on ``node``: its own HOME and Ray temp dir, the head's GCS address."""
        return {
            "HOME": str(self.root / node / "home"),
            "RAY_TMPDIR": str(self.ray_tmp / node),
            "RAY_ADDRESS": f"{HEAD_IP}:{GCS_PORT}",
            "RAY_USAGE_STATS_ENABLED": "0",
            **self.auth,
            **extra,
        }

    def command(self, node: str, args: list[str], **env: str) -> list[str]:
        """``args`` run inside ``node``'s namespace with its environment."""
        pairs = [f"{k}={v}" for k, v in self.env(node, **env).items()]
        return ["ip", "netns", "exec", self.ns[node], "env", *pairs, *args]

    def run(self, node: str, args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, args, **env), capture_output=True, text=True, timeout=timeout)

    def popen(self, node: str, args: list[str], log: Path, **env: str) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, args, **env), stdout=log.open("w"), stderr=subprocess.STDOUT)

    def python(self, node: str, code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return self.run(node, [sys.executable, "-c", code], timeout=timeout, **env)

    # ------------------------------------------------------------------ Ray nodes
    def start_head(self, resources: dict[str, float] | None = None, **env: str) -> None:
        """Start the head (one CPU for Ray's scheduling, ``resources`` besides); ``env`` reaches its processes."""
        args = ["--head", f"--port={GCS_PORT}", "--num-cpus=1", "--include-dashboard=false"]
        self._ray_start("head", [*args, f"--resources={json.dumps(resources or {})}"], "start the head", **env)

    def start_worker(self, resources: dict[str, float] | None = None, **env: str) -> None:
        """Start (or restart) the worker, with ``WORKER_RESOURCE`` and ``resources``; ``env`` reaches every
        process Ray starts there."""
        resources = json.dumps({WORKER_RESOURCE: 4, **(resources or {})})
        self._ray_start(
            "worker",
            [f"--address={HEAD_IP}:{GCS_PORT}", f"--num-cpus={self.worker_cpus}", f"--resources={resources}"],
            "start the worker",
            **env,
        )

    def _ray_start(self, node: str, args: list[str], what: str, **env: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        out = self.run(
            node,
            [ray, "start", f"--node-ip-address={self.ips[node]}", "--object-store-memory=100000000", *args],
            **env,
        )
        if out.returncode != 0:
            raise RuntimeError(f"could not {what}: {out.stdout[-2000:]}{out.stderr[-2000:]}")

    def pids(self, node: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns[node]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, node: str) -> float:
        """SIGKILL every process in ``node``'s namespace (a machine lost); returns when it was done."""
        for pid in self.pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def teardown(self) -> None:
        """Kill our namespaces' processes, then delete the namespaces (the veth pair goes with them)."""
        for node, ns in self.ns.items():
            if ns not in self.made:
                continue
            for _ in range(50):
                pids = self.pids(node)
                if not pids:
                    break
                self.kill_node(node)
                time.sleep(0.1)
        for ns in reversed(self.made):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
        self.made.clear()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
