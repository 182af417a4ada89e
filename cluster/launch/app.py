"""The kvmesh application: the ingress in front of the engine deployment and its KV-aware router.

``build_app`` is what ``kvmesh serve`` runs; ``app_builder`` is the same for Ray Serve config files
(``import_path: kvmesh.cluster.launch.app:app_builder`` with ``args:`` holding ``ClusterConfig`` fields), as a KubeRay
``serveConfigV2`` uses it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray import serve

from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.ingress.admission import key_digests
from kvmesh.cluster.ingress.deployment import Ingress
from kvmesh.cluster.ingress.front_door import IngressSettings
from kvmesh.cluster.launch.config import APP_NAME, PROBE_DEADLINE_ENV, PROBE_DEADLINE_S, ClusterConfig, build_config
from kvmesh.cluster.workers.mixed_deployment import OwnedEngines, mixed_deployment
from kvmesh.cluster.workers.worker_proxy import worker_deployment
from kvmesh.core.sampling_params import MAX_N
from kvmesh.router.index_schema import REDIS_URL_ENV, index_redis_url


def with_env(actor_options: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """``actor_options`` with ``env`` added to its runtime environment's variables (a copy)."""
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
    return {**actor_options, "runtime_env": runtime_env}


def build_app(
    config: ClusterConfig, serve_grpc: bool = False, env: dict[str, str] | None = None, engine_nodes: int = 1
) -> serve.Application:
    """The application. ``config.redis_url`` None: every process reads ``$KVMESH_REDIS_URL`` (``env`` sets
    variables in every replica's environment: how ``kvmesh serve`` hands them the embedded Redis's URL).
    ``serve_grpc``: the ingress listens for gRPC on ``config.host:config.grpc_port`` itself (``kvmesh serve``;
    under a Serve config file Ray's gRPC proxy serves it instead). ``engine_nodes``: how many nodes can hold
    engine replicas (each CPU replica takes its share of its node's cores)."""
    env = env or {}
    engine = _engines(config, env, engine_nodes)
    # Ray's own limit sits above ours, so the ingress answers 429 itself while /health and /metrics still pass.
    ongoing = config.max_inflight_requests + 64 if config.max_inflight_requests else 100_000
    deadline = {PROBE_DEADLINE_ENV: os.environ.get(PROBE_DEADLINE_ENV, PROBE_DEADLINE_S)}
    actor = with_env(config.ingress_actor_options, {**deadline, **env})
    return Ingress.options(
        num_replicas=config.ingress_replicas, max_ongoing_requests=ongoing, ray_actor_options=actor
    ).bind(engine, ingress_settings(config, serve_grpc))


def ingress_settings(config: ClusterConfig, serve_grpc: bool) -> IngressSettings:
    """What each ingress replica is given: the model and hashing it agrees on with the engines, its limits."""
    grpc = serve_grpc and bool(config.grpc_port)
    return IngressSettings(
        model=config.model,
        served_model_name=config.name,
        block_size=config.engine.block_size,
        max_model_len=config.engine.max_model_len,
        max_n=min(MAX_N, config.engine.max_num_seqs),
        redis_url=config.redis_url,
        deployment=APP_NAME,
        policy=config.policy,
        api_key_digests=key_digests(config.api_keys),
        max_inflight_requests=config.max_inflight_requests,
        max_request_bytes=config.max_request_bytes,
        grpc_host=config.host if grpc else None,
        grpc_port=config.grpc_port if grpc else None,
        share_prefix_cache=config.share_prefix_cache,
        enable_docs=config.enable_docs,
        no_replica_timeout_s=config.no_replica_timeout_s,
        enable_lora=config.engine.enable_lora,
        lora_modules=dict(config.engine.lora_modules or {}),
        lora_roots=[str(Path(root).resolve()) for root in config.lora_roots],
    )


def _engines(config: ClusterConfig, env: dict[str, str], engine_nodes: int) -> serve.Application:
    """The engine deployment: kvmesh's engines, one proxy per external worker (``config.workers``), or both
    mixed (``cluster/workers/mixed_deployment.py``), behind the same router settings."""
    routing, replicas = config.routing(), with_env({"num_cpus": 0}, env)
    kv_events = config.kv_events_config if config.kv_events_config.enabled else None
    per_node = config.replicas_per_node(engine_nodes)
    if config.workers and config.replicas:
        engines = OwnedEngines(
            engine=config.engine,
            actor_options=with_env(config.engine_actor_options, env),
            replicas_per_node=per_node,
            kv_events=kv_events,
        )
        return mixed_deployment(
            config.workers, config.name, routing, engines, config.replicas, replicas, config.drain_timeout_s
        )
    if config.workers:
        block_size = config.engine.block_size
        return worker_deployment(config.workers, config.model, config.name, block_size, routing, replicas)
    return engine_deployment(
        config.engine,
        routing,
        num_replicas=config.replicas,
        ray_actor_options=with_env(config.engine_actor_options, env),
        autoscaling=config.autoscaling_config(),
        drain_timeout_s=config.drain_timeout_s,
        replicas_per_node=per_node,
        kv_events=kv_events,
        prefill_replicas=config.prefill_replicas,
        keep_kv=config.keep_kv,
    )


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application-builder entry point: ``args`` are ``ClusterConfig`` fields. The index Redis is
    ``$KVMESH_REDIS_URL`` in every pod (on Kubernetes, from a Secret), so its password is not in the
    RayService spec; ``args["redis_url"]`` overrides it. No embedded Redis here."""
    config = build_config(overrides=dict(args))
    if not index_redis_url(config.redis_url):
        raise ValueError(f"the index Redis is required when deploying from a Serve config file (${REDIS_URL_ENV})")
    return build_app(config)
