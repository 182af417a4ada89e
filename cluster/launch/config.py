"""Cluster configuration: defaults that start on a laptop, a YAML file, command-line flags over both.

One ``ClusterConfig`` describes a deployment. ``kvmesh serve`` builds it from (lowest to highest) these
defaults, ``--config FILE`` and the flags a user typed. Engine settings live under ``engine:`` and are
``EngineConfig`` fields, checked by it, so there is one definition of each. The file and the flags give
mappings; ``ClusterConfig`` turns each into its record (``EngineConfig``, ``WorkerSpec``, ``KVEventsConfig``),
and those records are what reaches the replicas through Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvmesh.cluster.engines.autoscaling import autoscaling_config
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.cluster.workers.worker_spec import WorkerSpec, distinct
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.model_files import DEFAULT_MODEL
from kvmesh.router.baselines import make_policy

PROBE_DEADLINE_ENV = "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S"
PROBE_DEADLINE_S = "0.5"
"""How long the routers (in the ingress processes) wait for a replica's queue-length probe before trying their
next choice. Ray's 0.1 s is missed by a busy CPU replica, and the request then leaves the replica holding its
prefix for a full recompute elsewhere; Ray doubles it on each retry, up to 1 s. An environment value wins.
Ray Serve reads it when first imported, so it must be in a router process's environment from its start
(here: torch-free and Ray-free, so test and benchmark launchers can set it before importing Ray)."""

APP_NAME = "kvmesh"
HEAD = "node:__internal_head__"
"""The resource Ray gives only its head node."""
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 9000
GRPC_SERVICER = "kvmesh.cluster.ingress.proto.kvmesh_pb2_grpc.add_KVMeshServicer_to_server"


@dataclass
class ClusterConfig:
    model: str = DEFAULT_MODEL
    """Alias, Hugging Face directory, .gguf file or hub id; every engine replica loads it."""
    served_model_name: str | None = None
    """The name clients send as ``model`` (default: ``model``)."""
    replicas: int | None = None
    """kvmesh's own engine replicas (the starting count when autoscaling): 2 by default, 0 with ``workers``;
    more beside ``workers`` mixes them (``cluster/workers/mixed_deployment.py``)."""
    workers: list[WorkerSpec] = field(default_factory=list)
    """External OpenAI-compatible engines to route (vLLM, SGLang, ``kvmesh engine``): ``url`` and, for KV-aware
    routing, their vLLM-style event endpoints ``kv_events`` and ``replay`` (``cluster/workers/worker_proxy.py``)."""
    min_replicas: int = 1
    max_replicas: int | None = None
    """Autoscale the engine replicas between ``min_replicas`` and this; ``None`` keeps ``replicas`` fixed."""
    scaling_policy: str = "kv_pressure"
    """``kv_pressure`` (KV demand near ``target_kv_util``) or ``ongoing_requests`` (Ray Serve's default)."""
    target_kv_util: float = 0.7
    """KV demand per replica the autoscaler aims for, as a share of its pool."""
    autoscaling: dict[str, Any] = field(default_factory=dict)
    """Further Ray ``AutoscalingConfig`` fields (upscale_delay_s, downscale_delay_s, metrics_interval_s, ...)."""
    drain_timeout_s: float = 60.0
    """How long a replica being removed may take to finish its in-flight streams."""
    prefill_replicas: int = 0
    """Engine replicas (the lowest ranks) that only prefill prompts other replicas fetch and decode (conditional
    disaggregation, ``docs/routing.md``); 0: every replica prefills and decodes."""
    keep_kv: bool = True
    """A starting replica pulls its peers' hottest blocks before it serves, and a removed one hands its own to
    the survivors (``docs/operations.md``); off: replicas start cold and their cache goes with them."""
    ingress_replicas: int = 1
    """Ingress replicas; each runs its own router on the engine handle (they share the Redis index)."""
    policy: str = "kv_aware"
    """Routing policy: kv_aware, or a baseline (pow2 = Ray's default, round_robin, session_hash, approx_tree)."""
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=dict)
    """Each engine replica's settings (block_size, max_num_seqs, kv_cache_bytes, max_model_len, device, ...):
    given as a mapping of ``EngineConfig`` fields (``model`` is this config's)."""
    engine_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    """Ray actor options of each engine replica (``num_cpus``, ``num_gpus``, ``resources``, ...). No CPUs by
    default, so several replicas share a laptop; on a cluster, claim a GPU (or CPUs) per replica so replicas
    land on worker nodes and the Ray autoscaler adds nodes for those that do not fit."""
    ingress_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0, "resources": {HEAD: 0.001}})
    """Ray actor options of the ingress: where HTTP's routes, the routers and gRPC run. The head node by
    default, so the endpoints ``kvmesh serve`` prints are on the machine it runs on; another node by its
    resource (``resources: {ingress_pool: 1}``) or label."""
    address: str | None = None
    """Join this Ray cluster (``auto`` or ``host:port``) instead of starting a local one. The embedded Redis
    then listens on this node's address too, so every node reaches it."""
    redis_url: str | None = None
    """The index's Redis; ``None`` takes ``$KVMESH_REDIS_URL``, else starts an embedded one (loopback, random
    password). Every process reads it from its environment: it is never a deployment argument."""
    host: str = "127.0.0.1"
    """Where HTTP and gRPC listen; a locally started Ray listens on loopback whatever this is."""
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    """gRPC on ``host``, served by the ingress itself, with HTTP's API keys and body limit; 0: no gRPC."""
    max_ongoing_requests: int = 64
    """Requests one engine replica accepts at once; more wait in the router's queue."""
    max_queued_requests: int = 256
    """Requests each router may hold waiting for a replica; beyond it, 503 with Retry-After (-1: no bound)."""
    max_inflight_requests: int = 1024
    """Generations one ingress replica handles at once; beyond it, 429 with Retry-After (0: no bound)."""
    max_request_bytes: int | None = None
    """Largest request body, HTTP and gRPC (413 / RESOURCE_EXHAUSTED beyond it); None: what the longest
    prompt that fits the context can take."""
    api_keys: list[str] = field(default_factory=list)
    """Bearer keys required on /v1 and /status (HTTP) and on gRPC; also read from ``$KVMESH_API_KEYS``.
    Empty: no authentication. The ingress is given their SHA-256 digests, never the keys."""
    share_prefix_cache: bool = False
    """With API keys, each key hashes its prompts into a prefix cache of its own (tenants neither share nor
    can probe each other's cached prefixes); True shares one cache across keys."""
    enable_docs: bool = False
    """Serve the API's ``/docs``, ``/redoc`` and ``/openapi.json``."""
    no_replica_timeout_s: float = 5.0
    """How long a request waits while no engine replica is alive before it is answered 503 with Retry-After."""
    kv_events_config: KVEventsConfig = field(default_factory=dict)
    """vLLM's ``--kv-events-config`` (same keys): each engine replica also publishes its KV events on ZMQ, ports
    offset by its replica rank, for routers that read vLLM's events (``docs/kv_events.md``)."""
    lora_roots: list[str] = field(default_factory=list)
    """Directories ``POST /v1/load_lora_adapter`` may load adapters from (engine ``enable_lora`` on); none: the
    route loads nothing. Adapters served from the start are the engine's ``lora_modules``."""
    stats_period_s: float = 1.0
    num_cpus: int | None = None
    """CPUs of a locally started Ray (default: this machine's)."""
    object_store_memory: int = 256 << 20

    def __post_init__(self) -> None:
        if self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}")
        self.engine = _engine_config(self.model, self.engine)  # raises ValueError on bad engine settings
        if self.lora_roots and not self.engine.enable_lora:
            raise ValueError("lora_roots needs engine.enable_lora (or --enable-lora)")
        self.workers = distinct([w if isinstance(w, WorkerSpec) else WorkerSpec(**w) for w in self.workers])
        if not isinstance(self.kv_events_config, KVEventsConfig):
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if self.replicas is None:
            self.replicas = 0 if self.workers else 2
        self._check_workers()
        if not isinstance(self.policy_kwargs, dict):
            raise ValueError(f"policy_kwargs must be a mapping, got {self.policy_kwargs!r}")
        make_policy(self.policy, **self.policy_kwargs)  # raises ValueError on a bad policy or setting
        if not 0 < self.http_port < 65536:
            raise ValueError(f"port {self.http_port} is out of range")
        if not 0 <= self.grpc_port < 65536:
            raise ValueError(f"port {self.grpc_port} is out of range (0 turns gRPC off)")
        self.autoscaling_config()  # and on bad autoscaling settings
        if self.max_queued_requests < -1 or self.max_inflight_requests < 0:
            raise ValueError("max_queued_requests must be >= -1 and max_inflight_requests >= 0")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not 0 < self.no_replica_timeout_s <= 600:
            raise ValueError(f"no_replica_timeout_s must be in (0, 600], got {self.no_replica_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.prefill_replicas < max(self.replicas, 1):
            raise ValueError(
                f"prefill_replicas must be >= 0 and leave a replica that decodes: {self.prefill_replicas} of "
                f"{self.replicas} replicas"
            )

    def _check_workers(self) -> None:
        if not self.workers and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1 (or 0 with workers), got {self.replicas}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.workers and self.max_replicas is not None:
            raise ValueError("autoscaling (max_replicas) is for kvmesh's own replicas alone, not beside workers")

    @property
    def engine_replicas(self) -> int:
        """Replicas of the engine deployment: one per external worker, then kvmesh's own engines."""
        return len(self.workers) + self.replicas

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def routing(self) -> RoutingSettings:
        """How the engine deployment is routed and bounded."""
        return RoutingSettings(
            redis_url=self.redis_url,
            deployment=APP_NAME,
            policy=self.policy,
            policy_kwargs=self.policy_kwargs,
            stats_period_s=self.stats_period_s,
            max_ongoing_requests=self.max_ongoing_requests,
            max_queued_requests=self.max_queued_requests,
        )

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Ray's ``autoscaling_config`` for the engine deployment, or ``None`` for a fixed size."""
        if self.max_replicas is None:
            return None
        return autoscaling_config(
            self.min_replicas,
            self.max_replicas,
            self.replicas,
            self.scaling_policy,
            self.target_kv_util,
            self.autoscaling,
        )

    def replicas_per_node(self, engine_nodes: int = 1) -> int:
        """The most engine replicas one node may hold, spread over ``engine_nodes``: replicas sharing a
        node split its cores among them, so a scaled-out node is not oversubscribed."""
        return -(-max(self.replicas, self.max_replicas or 0) // max(1, engine_nodes))


def _engine_config(model: str, engine: EngineConfig | dict[str, Any]) -> EngineConfig:
    """``engine`` as an ``EngineConfig`` of ``model`` (``torch_threads`` left unset: each replica sizes it on
    its own node, ``kvmesh.cluster.hosting.nodes.replica_threads``)."""
    if isinstance(engine, EngineConfig):
        if engine.model != model:
            raise ValueError(f"engine.model {engine.model!r} is not the cluster's model {model!r}")
        return engine
    if not isinstance(engine, dict):
        raise ValueError(f"engine must be a mapping of engine settings, got {engine!r}")
    try:
        return EngineConfig(model=model, **engine)
    except TypeError as exc:
        raise ValueError(f"engine: {exc}") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings at the top level")
    return data


def build_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Defaults <- YAML file <- overrides (flags; ``None`` values mean "not given"). Engine and autoscaling
    keys merge."""
    values = load_yaml(file) if file else {}
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{file}: unknown settings {unknown}; known: {sorted(known)}")
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key in ("engine", "autoscaling"):
            values[key] = {**(values.get(key) or {}), **value}  # mappings here: records only once built
        else:
            values[key] = value
    return ClusterConfig(**values)
