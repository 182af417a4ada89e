"""``kvmesh engine``: one kvmesh engine as an OpenAI-compatible HTTP server, without Ray or Redis.

The analogue of ``vllm serve``, so any router (SGLang's ``smg``, ``vllm-router``, Dynamo, llm-d, or kvmesh's own
``workers:``) can put kvmesh engines behind it: the same routes as the cluster's ingress (chat, completions,
tokenize, detokenize, models, health, metrics), its KV events on vLLM's wire with ``--kv-events-config``.
It is the ingress's own front door (``kvmesh.cluster.ingress.front_door.front_door``) over an engine in this process:
``LocalHandle`` stands where the deployment handle would.
"""

from __future__ import annotations

import argparse
import json
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.cluster.hosting.listen import listen, serve_all
from kvmesh.cluster.ingress.admission import key_digests
from kvmesh.cluster.ingress.front_door import IngressSettings, front_door
from kvmesh.cluster.ingress.generation import LocalHandle
from kvmesh.cluster.ingress.http_api import HttpApi, bound_app
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.messages import LOAD_HEADER, ReplicaStatus
from kvmesh.core.sampling_params import MAX_N

log = logging.getLogger(__name__)


class EngineServer(HttpApi):
    """The HTTP routes over one local engine; status and metrics report that engine (its metrics also under
    vLLM's names, for routers and gateways built around vLLM)."""

    vllm_metric_names = True

    def __init__(self, replica: EngineReplica, settings: IngressSettings) -> None:
        self.replica = replica
        self.settings = settings
        self.index = None
        self.generation, self.admission = front_door(settings, LocalHandle(replica.generate))

    async def health(self) -> JSONResponse:
        """``ok`` once the engine is loaded (the server listens only then); no router sits in front here."""
        return JSONResponse({"status": "ok"})

    async def reset_prefix_cache(self) -> JSONResponse:
        """vLLM's ``POST /reset_prefix_cache``: forget every cached block (its KV events say so); 409 while
        requests run. For benchmarks that give each router cold caches."""
        if await self.replica.llm.reset_prefix_cache():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "busy", "reason": "requests hold blocks"}, status_code=409)

    async def load(self) -> JSONResponse:
        """``GET /load``: the engine's ``LoadReport`` (measured prefill and decode rates, free KV blocks, batch
        limit, gauges), what kvmesh's routers price a replica by; a router in front of ``kvmesh engine`` servers
        reads it instead of ``/metrics``, where a vLLM worker offers only request counts."""
        return JSONResponse(self.replica.record_routing_stats())

    def _load_headers(self) -> dict[str, str]:
        """The engine's ``LoadReport`` as each response starts (after its first token: the request counts as
        running), so a router sending here reads the engine's load without a ``GET /load``."""
        return {LOAD_HEADER: json.dumps(self.replica.record_routing_stats(), separators=(",", ":"))}

    async def _load_adapter(self, name: str, path: str) -> str | None:
        """Read the adapter into this engine, between two of its steps; why it cannot be served, or None."""
        return await self.replica.load_lora(name, path)

    async def _unload_adapter(self, name: str) -> None:
        await self.replica.llm.between_steps(lambda: self.replica.engine.unload_lora(name))

    async def _replica_reports(self) -> dict[str, ReplicaStatus]:
        return {self.replica.index_id: self.replica.status()}


def build_app(server: EngineServer) -> FastAPI:
    """The front door's routes bound to ``server``, vLLM's ``POST /reset_prefix_cache`` and ``GET /load``; the
    engine's KV blocks served to peers from start-up (``GET /load`` names the address)."""
    engine_app = bound_app(server, "kvmesh engine")
    engine_app.add_api_route("/reset_prefix_cache", server.reset_prefix_cache, methods=["POST"])
    engine_app.add_api_route("/load", server.load, methods=["GET"])
    engine_app.router.on_startup.append(server.replica.start_peer)
    return engine_app


def run_engine_server(args: argparse.Namespace, engine: EngineConfig, kv_events: KVEventsConfig | None) -> int:
    """``kvmesh engine``: ``--engines`` engines (more than one only simulated), each on its own port."""
    count = args.engines
    if count < 1 or (count > 1 and engine.simulate is None):
        raise ValueError(f"--engines {count}: one engine per process, or several with --simulate")
    socks = [listen(args.host, args.port + rank) for rank in range(count)]
    servers = [_engine_server(args, engine, kv_events, rank) for rank in range(count)]
    name = servers[0].settings.served_model_name
    urls = ", ".join(f"http://{args.host}:{args.port + rank}/v1" for rank in range(count))
    events = f", KV events on {servers[0].replica.kv_events.config.endpoint}" if servers[0].replica.kv_events else ""
    more = f" (+{count - 1} on the next ports)" if count > 1 else ""
    ready = f"kvmesh engine ready: {urls if count < 4 else f'http://{args.host}:{args.port}/v1'}{more} ({name}{events})"
    serve_all([(build_app(server), sock) for server, sock in zip(servers, socks, strict=True)], ready)
    for server in servers:
        server.replica.close()
    return 0


def _engine_server(args: argparse.Namespace, engine: EngineConfig, kv_events: KVEventsConfig | None, rank: int):
    """The ``rank``-th engine of this process behind its routes (KV event ports offset by the rank)."""
    replica = EngineReplica(
        engine,
        redis_url=None,
        kv_events=kv_events.for_rank(rank) if kv_events else None,
        kv_host=args.host,
        kv_port=args.kv_transfer_port + rank if args.kv_transfer_port else 0,
    )
    config = replica.engine.config
    settings = IngressSettings(
        model=args.model,
        served_model_name=args.served_model_name or args.model,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_n=min(MAX_N, config.max_num_seqs),
        api_key_digests=key_digests(args.api_key or []),
        max_inflight_requests=args.max_inflight_requests,
        enable_lora=config.enable_lora,
        lora_modules=dict(config.lora_modules or {}),
        lora_roots=list(args.lora_root or []),
    )
    return EngineServer(replica, settings)
