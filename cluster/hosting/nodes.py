"""Ray nodes as kvmesh sees them: where a process runs, which nodes can hold engine replicas, how many
threads a replica takes there, and each node's one-time preparation before its replicas start.

A node's first replica would otherwise pay, inside Serve's start-up timeout, for converting the model
(a GGUF is dequantized once per node, into that node's cache) and for compiling the C++ CPU kernels (once
per node and CPU type). ``prepare_nodes`` does both in a Ray task pinned to each node, before the
deployment, so ``kvmesh serve`` shows them as progress; a node that joins later prepares inside its first
replica's start, as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus(cgroup_cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota. In a Kubernetes pod
    ``os.cpu_count()`` is the node's core count while the pod's CPU limit is the quota; sizing threads from
    the node would oversubscribe the pod."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cgroup_cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def replica_threads(replicas_per_node: int, claimed_cpus: float | None, cores: int) -> int:
    """Torch threads of one CPU engine replica: the CPUs it claimed from Ray, else an equal share of its
    node's cores among the replicas that node may hold."""
    if claimed_cpus and claimed_cpus >= 1:
        return int(claimed_cpus)
    return max(1, cores // max(1, replicas_per_node))


def node_address() -> str:
    """The address of the Ray node this process runs on (its raylet's), as other nodes reach it. A process that
    never imported Ray (``kvmesh engine``) is on no Ray node: the address its host sends from, found as Ray
    finds it (a UDP socket's own address; nothing is sent), or loopback without a route."""
    if "ray" in sys.modules:
        import ray

        return ray.util.get_node_ip_address()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address will do
        return probe.getsockname()[0]
    return "127.0.0.1"


def claimed_cpus() -> float | None:
    """CPUs Ray assigned to the calling actor or task (None outside one: a driver has no assignment, and a
    process that never imported Ray runs in none)."""
    if "ray" not in sys.modules:
        return None
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_assigned_resources().get("CPU")
    except AssertionError:  # Ray asserts it is called from a worker, not a driver
        return None


def fits(node: dict[str, Any], actor_options: dict[str, Any]) -> bool:
    """Whether a node (an entry of ``ray.nodes()``) has every resource an engine replica asks for."""
    have = node.get("Resources", {})
    want = dict(actor_options.get("resources") or {})
    if actor_options.get("num_gpus"):
        want["GPU"] = actor_options["num_gpus"]
    if actor_options.get("num_cpus"):
        want["CPU"] = actor_options["num_cpus"]
    return all(have.get(name, 0) >= amount for name, amount in want.items())


def engine_nodes(actor_options: dict[str, Any]) -> list[dict[str, Any]]:
    """The live Ray nodes an engine replica with these actor options could be placed on."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and fits(n, actor_options)]


@dataclass(slots=True, kw_only=True)
class NodePrepared:
    """What preparing one node did, and how long each part took."""

    node: str
    cpus: int
    model_s: float
    kernels_s: float | None
    """Seconds to build (or find built) the C++ CPU kernels; None where the engines do not run on the CPU."""
    kernels: bool = True
    """False where the kernels could not be built (the torch paths serve, slower)."""


def prepare_this_node(model: str, device: str | None) -> NodePrepared:
    """Resolve the model on this node (converting a GGUF into its cache) and build the CPU kernels."""
    from kvmesh.core.model_files import resolve_model_dir

    start = time.perf_counter()
    resolve_model_dir(model)
    model_s = time.perf_counter() - start
    kernels_s, kernels = None, True
    if device in (None, "cpu"):
        from kvmesh.kernels.cpu_extension import build_cpu_kernels

        start = time.perf_counter()
        kernels = build_cpu_kernels()
        kernels_s = time.perf_counter() - start
    return NodePrepared(
        node=node_address(), cpus=available_cpus(), model_s=model_s, kernels_s=kernels_s, kernels=kernels
    )


def prepare_nodes(
    model: str, device: str | None, actor_options: dict[str, Any], say: Callable[[str], None]
) -> list[NodePrepared]:
    """Prepare every node that can hold an engine replica, at once, saying each one's result as it lands."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = engine_nodes(actor_options)
    if not nodes:
        say("no live Ray node has the resources an engine replica asks for yet; replicas wait for one")
        return []
    task = ray.remote(num_cpus=0, max_retries=0)(prepare_this_node)
    env = {"runtime_env": actor_options["runtime_env"]} if actor_options.get("runtime_env") else {}
    pending = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False), **env).remote(
            model, device
        )
        for n in nodes
    ]
    say(f"preparing {len(nodes)} node(s) for engine replicas: model files, CPU kernels ...")
    start, done = time.monotonic(), []
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        result = ray.get(ready[0])
        done.append(result)
        kernels = "" if result.kernels_s is None else f", CPU kernels {result.kernels_s:.1f} s"
        if not result.kernels:
            kernels += " (unavailable: the torch paths serve)"
        say(
            f"[{time.monotonic() - start:6.1f} s] node {result.node} ready ({result.cpus} cores): "
            f"model {result.model_s:.1f} s{kernels}"
        )
    return done


def replica_rank(rank: object) -> int:
    """A Serve replica context's ``rank`` as a number (an int, or a ``ReplicaRank`` in newer Rays; 0 outside)."""
    return rank if isinstance(rank, int) else getattr(rank, "rank", 0)
