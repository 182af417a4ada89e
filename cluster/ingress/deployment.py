"""The ingress: the Ray Serve deployment that is kvmesh's front door, HTTP (``cluster/ingress/http_api.py``) and
gRPC (``cluster/ingress/grpc_api.py``) over one ``Generation`` (``cluster/ingress/generation.py``).

The ingress validates a request, renders the chat template, tokenizes ONCE and hashes the prompt's blocks
ONCE, then calls the engine deployment's handle with a ``GenerateCall``: the KV-aware router on that
handle (in this process) reads the hashes to pick a replica, and the replica reuses them for its prefix
cache. It also sweeps crashed replicas out of the index. It must not import torch (the ingress process
stays small): it uses the tokenizer alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from kvmesh.cluster.hosting.nodes import node_address
from kvmesh.cluster.ingress.front_door import IngressSettings, front_door
from kvmesh.cluster.ingress.generation import HandleErrors
from kvmesh.cluster.ingress.grpc_api import GrpcApi, serve_grpc
from kvmesh.cluster.ingress.http_api import HttpApi, app, set_admission
from kvmesh.router.index_schema import index_redis_url
from kvmesh.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)
ADAPTER_SYNC_S = 1.0
"""How often an ingress reads the adapters other ingress replicas loaded or unloaded at run time."""

RAY_HANDLE_ERRORS = HandleErrors(replica_failed=(RayActorError, ActorUnavailableError), overloaded=(BackPressureError,))
"""What a Serve deployment handle raises when the replica serving a call died or became unreachable, and when
every replica is busy and the queue is full."""


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress(HttpApi, GrpcApi):
    def __init__(self, engine_handle: DeploymentHandle, settings: IngressSettings) -> None:
        # Ray ships this class by value (its name in this module is the deployment), so nothing else makes the
        # replica import this module; the routes bind to the class (serve.ingress above) only when it does.
        importlib.import_module(__name__)
        self.settings = s = settings
        self.engines = engine_handle
        self.generation, self.admission = front_door(s, engine_handle, RAY_HANDLE_ERRORS)
        set_admission(self.admission)
        redis_url = index_redis_url(s.redis_url)
        self.index = PrefixIndex(redis_url, s.deployment, s.model, timeout_s=1.0) if redis_url else None
        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self.index.sweep_forever()) if self.index else None
        self._unloaded: set[str] = set()
        """Adapters this ingress unloaded whose shared entry may still be read before it is deleted."""
        sync = self.index is not None and s.enable_lora
        self._adapter_sync = loop.create_task(self._sync_adapters_forever()) if sync else None
        self._grpc_server = None
        if s.grpc_port:
            self._grpc_server = serve_grpc(self, s.grpc_host or "127.0.0.1", s.grpc_port, self.admission.max_body_bytes)
            self._grpc_started = loop.create_task(self._grpc_server.start())

    async def _load_adapter(self, name: str, path: str) -> str | None:
        """Read the adapter on the replica the router picks, then share it with the other ingress replicas."""
        reason = await super()._load_adapter(name, path)
        if reason is None and self.index is not None:
            self._unloaded.discard(name)
            try:
                await self.index.client.hset(self.index.prefix + "loras", name, path)
            except Exception as exc:  # Redis down: this ingress serves it; the others will not know it
                log.warning("adapter %s is served by this ingress only (Redis: %r)", name, exc)
        return reason

    async def _unload_adapter(self, name: str) -> None:
        if self.index is not None:
            self._unloaded.add(name)
            with contextlib.suppress(Exception):
                await self.index.client.hdel(self.index.prefix + "loras", name)

    async def _sync_adapters_forever(self) -> None:
        """Serve the adapters other ingress replicas loaded at run time, and stop serving those they unloaded
        (the ``--lora-modules`` ones are served from the start by every ingress)."""
        adapters, fixed, seen = self.generation.adapters, set(self.settings.lora_modules), set()
        while True:
            await asyncio.sleep(ADAPTER_SYNC_S)
            try:
                raw = await self.index.client.hgetall(self.index.prefix + "loras")
            except Exception:  # Redis down: keep what is known
                continue
            shared = {k.decode(): v.decode() for k, v in raw.items()}
            self._unloaded &= set(shared)
            for name, path in shared.items():
                if name not in self._unloaded:
                    adapters.setdefault(name, path)
            # Only what was shared and no longer is: one loaded here while this read was on its way stays.
            for name in seen - set(shared) - fixed:
                adapters.pop(name, None)
            seen = set(shared)

    def node(self) -> str:
        """The address of the node this ingress runs on (its gRPC listens there): what ``kvmesh serve`` prints."""
        return node_address()

    def __del__(self) -> None:
        """Ray Serve calls this when the replica stops: close this ingress's gRPC server (if it runs one)."""
        server = getattr(self, "_grpc_server", None)
        if server is not None:
            with contextlib.suppress(RuntimeError):  # no loop left: the process is exiting, the socket with it
                asyncio.get_running_loop().create_task(server.stop(grace=1.0))
