"""``kvmesh engine``: one kvmesh engine as an OpenAI-compatible HTTP server, without Ray or Redis.

The analogue of ``vllm serve``, so any router (SGLang's ``smg``, ``vllm-router``, Dynamo, llm-d, or kvmesh's own
``workers:``) can put kvmesh engines behind it: the same routes as the cluster's ingress (chat, completions,
tokenize, detokenize, models, health, metrics), its KV events on vLLM's wire with ``--kv-events-config``.
It is the ingress's own front door (``kvmesh.cluster.ingress.front_door.front_door``) over an engine in this process:
``LocalHandle`` stands where the deployment handle would.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.cluster.hosting.listen import listen, serve
from kvmesh.cluster.ingress.admission import key_digests
from kvmesh.cluster.ingress.front_door import IngressSettings, front_door
from kvmesh.cluster.ingress.generation import LocalHandle
from kvmesh.cluster.ingress.http_api import HttpApi, bound_app, set_admission
from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.messages import ReplicaStatus
from kvmesh.core.sampling_params import MAX_N
from kvmesh.replica.lora_weights import LoRAError

log = logging.getLogger(__name__)


class LoadLoRA(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRA(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)


class EngineServer(HttpApi):
    """The HTTP routes over one local engine; status and metrics report that engine."""

    def __init__(self, replica: EngineReplica, settings: IngressSettings, lora_roots: list[str] | None = None) -> None:
        """``lora_roots``: the directories ``POST /v1/load_lora_adapter`` may load adapters from."""
        self.replica = replica
        self.settings = settings
        self.index = None
        self.generation, self.admission = front_door(settings, LocalHandle(replica.generate))
        set_admission(self.admission)
        self.lora_roots = [Path(r).resolve() for r in lora_roots or []]
        loras = replica.engine.loras
        for name in loras.names() if loras is not None else []:
            self.generation.adapters[name] = loras.get(name).path

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

    async def load_lora_adapter(self, body: LoadLoRA) -> JSONResponse:
        """vLLM's ``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` (under a ``--lora-root``)
        as model ``lora_name``; 400 with the reason if it cannot be served (the engine serves on unchanged)."""
        path = Path(body.lora_path).resolve()
        if not any(path.is_relative_to(root) for root in self.lora_roots):
            where = ", ".join(map(str, self.lora_roots)) or "none: start the engine with --lora-root DIR"
            raise APIError(f"lora_path must lie under a --lora-root directory ({where})", param="lora_path")
        if body.lora_name in self.generation.limits.names:
            raise APIError(f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:
            await self.replica.llm.between_steps(lambda: self.replica.engine.load_lora(body.lora_name, str(path)))
        except LoRAError as exc:
            raise APIError(str(exc), param="lora_path") from exc
        self.generation.adapters[body.lora_name] = str(path)
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    async def unload_lora_adapter(self, body: UnloadLoRA) -> JSONResponse:
        """vLLM's ``POST /v1/unload_lora_adapter``: stop serving ``lora_name`` (requests running on it finish on
        it); 404 if no adapter has that name."""
        if self.generation.adapters.pop(body.lora_name, None) is None:
            raise APIError(f"no LoRA adapter named {body.lora_name!r} is loaded", status=404, param="lora_name")
        await self.replica.llm.between_steps(lambda: self.replica.engine.unload_lora(body.lora_name))
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    async def _replica_reports(self) -> dict[str, ReplicaStatus]:
        return {self.replica.index_id: self.replica.status()}


def build_app(server: EngineServer) -> FastAPI:
    """The front door's routes bound to ``server``, vLLM's ``POST /reset_prefix_cache`` and ``GET /load``; the
    engine's KV blocks served to peers from start-up (``GET /load`` names the address)."""
    engine_app = bound_app(server, "kvmesh engine")
    engine_app.add_api_route("/reset_prefix_cache", server.reset_prefix_cache, methods=["POST"])
    engine_app.add_api_route("/load", server.load, methods=["GET"])
    if server.replica.engine.loras is not None:
        engine_app.add_api_route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"])
        engine_app.add_api_route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"])
    engine_app.router.on_startup.append(server.replica.start_peer)
    return engine_app


def run_engine_server(args: argparse.Namespace, engine: EngineConfig, kv_events: KVEventsConfig | None) -> int:
    sock = listen(args.host, args.port)
    replica = EngineReplica(
        engine, redis_url=None, kv_events=kv_events, kv_host=args.host, kv_port=args.kv_transfer_port
    )
    config = replica.engine.config
    digests = key_digests(args.api_key or [])
    settings = IngressSettings(
        model=args.model,
        served_model_name=args.served_model_name or args.model,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        max_n=min(MAX_N, config.max_num_seqs),
        api_key_digests=digests,
        max_inflight_requests=args.max_inflight_requests,
    )
    server = EngineServer(replica, settings, args.lora_root)
    events = f", KV events on {replica.kv_events.config.endpoint}" if replica.kv_events else ""
    ready = f"kvmesh engine ready: http://{args.host}:{args.port}/v1 ({settings.served_model_name}{events})"
    serve(build_app(server), sock, ready)
    replica.close()
    return 0
