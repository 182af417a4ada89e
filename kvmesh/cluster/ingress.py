"""The ingress: the Ray Serve deployment that is kvmesh's front door, HTTP (``kvmesh/cluster/http_api.py``) and
gRPC (``kvmesh/cluster/grpc_api.py``) over one ``Generation`` (``kvmesh/cluster/generation.py``).

The ingress validates a request, renders the chat template, tokenizes ONCE and hashes the prompt's blocks
ONCE, then calls the engine deployment's handle with a ``GenerateCall``: the KV-aware router on that
handle (in this process) reads the hashes to pick a replica, and the replica reuses them for its prefix
cache. It also sweeps crashed replicas out of the index. It must not import torch (the ingress process
stays small): it uses the tokenizer alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from ray import serve
from ray.serve.handle import DeploymentHandle

from kvmesh.cluster import metrics
from kvmesh.cluster.admission import Admission
from kvmesh.cluster.generation import Generation, ModelLimits
from kvmesh.cluster.grpc_api import GrpcApi, serve_grpc
from kvmesh.cluster.http_api import HttpApi, app, set_admission
from kvmesh.cluster.nodes import node_address
from kvmesh.router.index_schema import index_redis_url
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.shared.limits import prompt_byte_limit, request_body_limit
from kvmesh.shared.model_files import load_tokenizer, max_context, max_token_bytes, resolve_model_dir, vocab_size
from kvmesh.shared.sampling_params import MAX_N


@dataclass
class IngressSettings:
    """What the ingress must agree on with the engines (hash seed, block size) and what it serves as."""

    model: str
    """The model id the engines were configured with: it seeds the block hashes."""
    served_model_name: str
    block_size: int
    max_model_len: int | None = None
    max_n: int = MAX_N
    """The most choices a request may ask for: fewer than ``MAX_N`` when a replica runs fewer sequences at once
    (its ``max_num_seqs``), since a request's choices run together on one replica."""
    redis_url: str | None = None
    """The index's Redis; None reads ``$KVMESH_REDIS_URL`` (how ``kvmesh serve`` and Kubernetes pass it, so
    the password never travels in deployment arguments)."""
    deployment: str = "kvmesh"
    policy: str = "kv_aware"
    api_key_digests: list[str] = field(default_factory=list)
    max_inflight_requests: int = 0
    max_request_bytes: int | None = None
    """Largest request body (HTTP and gRPC); None derives it from the context length."""
    grpc_host: str | None = None
    grpc_port: int | None = None
    """Where this ingress serves gRPC itself (``kvmesh serve``); None: not at all (Ray's gRPC proxy may)."""
    share_prefix_cache: bool = False
    """With API keys, each key's requests hash into a prefix cache of their own unless this is set."""
    enable_docs: bool = False
    no_replica_timeout_s: float = 5.0
    """How long a request waits while no engine replica is alive before its 503."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")


def front_door(s: IngressSettings, engine_handle) -> tuple[Generation, Admission]:
    """The ``Generation`` over ``engine_handle`` and the ``Admission`` limits of one served model: what an
    ingress (here) and a single-engine server (``kvmesh/cluster/engine_server.py``) put in front of engines."""
    model_dir = resolve_model_dir(s.model, weights=False)  # tokenizer and config only
    tokenizer = load_tokenizer(model_dir)
    max_model_len = s.max_model_len or max_context(model_dir)
    token_bytes = max_token_bytes(tokenizer)
    limits = ModelLimits(
        names={s.served_model_name, s.model},
        served_name=s.served_model_name,
        vocab_size=vocab_size(model_dir),
        max_model_len=max_model_len,
        max_prompt_bytes=prompt_byte_limit(max_model_len, token_bytes),
        max_n=s.max_n,
    )
    generation = Generation(
        engine_handle, tokenizer, s.model, s.block_size, limits, s.share_prefix_cache, s.no_replica_timeout_s
    )
    admission = Admission(
        s.api_key_digests,
        s.max_inflight_requests,
        s.max_request_bytes or request_body_limit(max_model_len, token_bytes),
        on_refused=lambda reason: metrics.REFUSED.labels(reason).inc(),
        enable_docs=s.enable_docs,
    )
    return generation, admission


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress(HttpApi, GrpcApi):
    def __init__(self, engine_handle: DeploymentHandle, settings: dict) -> None:
        self.settings = s = IngressSettings(**settings)
        self.generation, self.admission = front_door(s, engine_handle)
        set_admission(self.admission)
        redis_url = index_redis_url(s.redis_url)
        self.index = PrefixIndex(redis_url, s.deployment, s.model, timeout_s=1.0) if redis_url else None
        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self.index.sweep_forever()) if self.index else None
        self._grpc_server = None
        if s.grpc_port:
            self._grpc_server = serve_grpc(self, s.grpc_host or "127.0.0.1", s.grpc_port, self.admission.max_body_bytes)
            self._grpc_started = loop.create_task(self._grpc_server.start())

    def node(self) -> str:
        """The address of the node this ingress runs on (its gRPC listens there): what ``kvmesh serve`` prints."""
        return node_address()

    def __del__(self) -> None:
        """Ray Serve calls this when the replica stops: close this ingress's gRPC server (if it runs one)."""
        server = getattr(self, "_grpc_server", None)
        if server is not None:
            with contextlib.suppress(RuntimeError):  # no loop left: the process is exiting, the socket with it
                asyncio.get_running_loop().create_task(server.stop(grace=1.0))
