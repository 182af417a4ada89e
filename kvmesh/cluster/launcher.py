"""``kvmesh serve``: start (or join) Ray, Redis, the ingress and the engine replicas; stop them all on exit.

Nothing listens wider than asked: HTTP and gRPC on ``--host``, a local Ray and the embedded Redis on
loopback, the Redis with a random password that every process reads from ``$KVMESH_REDIS_URL`` and that
is never printed.

Start-up shows its progress (model preparation, then each deployment's replicas as they come up) because
loading models takes a while. Ctrl-C or SIGTERM shut everything down in reverse order: the Serve app
(replicas finish their streams within the graceful-shutdown timeout and remove their index entries), then
the Ray processes this command started, then the embedded Redis. Nothing is left running.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable

from kvmesh.cluster.config import APP_NAME, ClusterConfig
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.router.index_schema import REDIS_URL_ENV, index_redis_url, redacted

log = logging.getLogger(__name__)

RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, a locally started Ray takes 127.0.0.1 as its node address and binds
every port there (what it does on macOS and Windows); read once, when ``ray`` is first imported."""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _watch_deployments(done: threading.Event, t0: float) -> None:
    """Print replica states whenever they change, until the app is up (``done``)."""
    from ray import serve

    last = ""
    while not done.wait(1.0):
        try:
            app = serve.status().applications.get(APP_NAME)
        except Exception:  # the controller may still be starting
            continue
        if app is None:
            continue
        parts = []
        for name, dep in sorted(app.deployments.items()):
            states = {str(k.value if hasattr(k, "value") else k).lower(): v for k, v in dep.replica_states.items()}
            total = sum(states.values())
            detail = ", ".join(f"{v} {k}" for k, v in sorted(states.items()) if k != "running")
            parts.append(f"{name} {states.get('running', 0)}/{total} running" + (f" ({detail})" if detail else ""))
        line = " | ".join(parts)
        if line and line != last:
            _say(f"[{time.monotonic() - t0:6.1f} s] {line}")
            last = line


def serve_cluster(
    config: ClusterConfig,
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
    on_ray_started: Callable[[], None] | None = None,
) -> int:
    """Run the cluster until ``stop`` is set. ``on_ray_started`` runs right after ``ray.init``, which
    replaces the process's SIGTERM handler: a caller that handles signals installs its own there."""
    from kvmesh.shared.model_files import resolve_model_dir

    stop = stop or threading.Event()
    t0 = time.monotonic()
    started_ray = False
    redis: EmbeddedRedis | None = None
    try:
        _say(f"preparing model {config.model} ...")
        resolve_model_dir(config.model)  # converts a GGUF once, here, before replicas race for it
        redis_url = index_redis_url(config.redis_url)
        if not redis_url:
            redis = EmbeddedRedis(password=secrets.token_urlsafe(24)).start()
            redis_url = redis.url
            _say(f"started embedded Redis at {redacted(redis_url)}")
            if config.address:
                _say("warning: the embedded Redis listens on loopback; pass --redis-url on a multi-node cluster")
        # Every process reads the URL (and its password) from its environment: processes started below
        # inherit this one's; on a joined cluster the job's runtime_env carries it.
        os.environ[REDIS_URL_ENV] = redis_url
        if not config.address:
            # A local Ray binds every one of its ports on loopback: nothing of it is reachable from outside.
            os.environ.setdefault(RAY_LOOPBACK_ENV, "0")
        import ray
        from ray import serve

        from kvmesh.cluster.app import build_app

        if not ray.is_initialized():
            _say(f"starting Ray{' (joining ' + config.address + ')' if config.address else ''} ...")
            ray.init(
                address=config.address,
                num_cpus=None if config.address else config.num_cpus,
                object_store_memory=None if config.address else config.object_store_memory,
                include_dashboard=False,
                namespace=APP_NAME,
                logging_level=logging.WARNING,
                runtime_env={"env_vars": {REDIS_URL_ENV: redis_url}} if config.address else None,
            )
            started_ray = config.address is None
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if on_ray_started is not None:
            on_ray_started()
        serve.start(
            http_options={"host": config.host, "port": config.http_port}, logging_config={"log_level": "WARNING"}
        )
        _say(f"deploying {config.replicas} engine replica(s) of {config.model} (policy {config.policy}) ...")
        deployed = threading.Event()
        watcher = threading.Thread(target=_watch_deployments, args=(deployed, t0), daemon=True)
        watcher.start()
        try:
            serve.run(
                build_app(config, serve_grpc=True),
                name=APP_NAME,
                route_prefix="/",
                logging_config={"log_level": "WARNING"},
            )
        finally:
            deployed.set()
        host = "localhost" if config.host in ("127.0.0.1", "0.0.0.0") else config.host
        grpc_line = (
            f"{host}:{config.grpc_port}  (kvmesh.KVMesh, kvmesh/cluster/proto/kvmesh.proto)"
            if config.grpc_port
            else "off"
        )
        _say(
            f"kvmesh is ready in {time.monotonic() - t0:.1f} s: serving {config.name}\n"
            f"  OpenAI HTTP  http://{host}:{config.http_port}/v1  (metrics: /metrics, status: /status)\n"
            f"  gRPC         {grpc_line}\n"
            f"  Redis index  {redacted(redis_url)}\n"
            "Press Ctrl-C to stop."
        )
        if on_ready is not None:
            on_ready()
        while not stop.wait(0.5):
            pass
        _say("shutting down ...")
        return 0
    finally:
        _shutdown(started_ray, redis)


def _shutdown(started_ray: bool, redis: EmbeddedRedis | None) -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            if started_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        except Exception as exc:  # keep going: Ray and Redis must still stop
            log.warning("serve shutdown: %r", exc)
        if started_ray:
            ray.shutdown()
    if redis is not None:
        redis.stop()
    _say("stopped")


def run_until_signalled(config: ClusterConfig) -> int:
    """``kvmesh serve``: SIGTERM and SIGINT both shut down cleanly; during start-up they abort it."""
    stop, ready = threading.Event(), threading.Event()

    def request_stop(signum, _frame) -> None:
        if not ready.is_set() or stop.is_set():  # still starting, or a second signal: stop waiting now
            raise KeyboardInterrupt
        stop.set()

    def install() -> None:
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    install()
    try:
        return serve_cluster(config, stop, on_ready=ready.set, on_ray_started=install)
    except KeyboardInterrupt:
        return 130
