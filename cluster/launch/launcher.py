"""``kvmesh serve``: start (or join) Ray, Redis, the ingress and the engine replicas; stop them all on exit.

Nothing listens wider than asked: HTTP and gRPC on ``--host``, a local Ray and the embedded Redis on
loopback. Joined to a cluster (``--address``), the embedded Redis also listens on this node's address, so
replicas on every node reach it. It has a random password that every replica reads from
``$KVMESH_REDIS_URL`` in its environment and that is never printed.

Start-up shows its progress (each node's preparation, then each deployment's replicas as they come up,
then the index hearing from every replica) because loading models takes a while; ``ready`` means every
engine replica serves and publishes to the index. Ctrl-C or SIGTERM shut everything down in reverse
order: the Serve app (replicas finish their streams within the graceful-shutdown timeout and remove their
index entries), then Serve and the Ray processes if this command started them, then the embedded Redis.
Nothing it started is left running.
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

from kvmesh.cluster.hosting.nodes import node_address, prepare_nodes
from kvmesh.cluster.launch.config import APP_NAME, ClusterConfig
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.router.index_schema import REDIS_URL_ENV, index_redis_url, redacted

log = logging.getLogger(__name__)

RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, a locally started Ray takes 127.0.0.1 as its node address and binds
every port there (what it does on macOS and Windows); read once, when ``ray`` is first imported."""


class ClusterConflict(ValueError):
    """The cluster cannot start as configured (a message for the operator, no traceback)."""


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
    from kvmesh.core.model_files import resolve_model_dir

    stop = stop or threading.Event()
    t0 = time.monotonic()
    started_ray = started_serve = deployed_app = False
    redis: EmbeddedRedis | None = None
    try:
        resolve_model_dir(config.model, weights=False)  # a wrong model name fails here, before Ray starts
        started_ray = _start_ray(config)
        if on_ray_started is not None:
            on_ray_started()
        redis_url = index_redis_url(config.redis_url)
        if not redis_url:
            # Joined to a cluster, replicas on other nodes must reach it: it listens on this node's address too.
            host = node_address() if config.address else None
            redis = EmbeddedRedis(password=secrets.token_urlsafe(24), host=host).start()
            redis_url = redis.url
            _say(f"started embedded Redis at {redacted(redis_url)}")
        started_serve = _start_serve(config)
        _refuse_running_app()
        deployed_app = True  # from here on, shutting down deletes the application
        ingress_node = _deploy(config, redis_url, t0)
        _wait_for_index(redis_url, config)
        endpoints = _endpoints(config, ingress_node, redis_url)
        _say(f"kvmesh is ready in {time.monotonic() - t0:.1f} s: serving {config.name}\n{endpoints}")
        if on_ready is not None:
            on_ready()
        while not stop.wait(0.5):
            pass
        _say("shutting down ...")
        return 0
    finally:
        _shutdown(started_ray, started_serve, deployed_app, redis)


def _start_ray(config: ClusterConfig) -> bool:
    """Start a local Ray (or join ``config.address``) unless this process already has one; True when this
    call started a local Ray, which shutting down then stops."""
    if not config.address:
        # A local Ray binds every one of its ports on loopback: nothing of it is reachable from outside.
        os.environ.setdefault(RAY_LOOPBACK_ENV, "0")
    import ray

    started = False
    if not ray.is_initialized():
        _say(f"starting Ray{' (joining ' + config.address + ')' if config.address else ''} ...")
        ray.init(
            address=config.address,
            num_cpus=None if config.address else config.num_cpus,
            object_store_memory=None if config.address else config.object_store_memory,
            include_dashboard=False,
            namespace=APP_NAME,
            logging_level=logging.WARNING,
        )
        started = config.address is None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    return started


def _refuse_running_app() -> None:
    """Stop before deploying over another command's application (shutting down would delete it)."""
    from ray import serve

    if APP_NAME in serve.status().applications:
        raise ClusterConflict(
            f"a {APP_NAME} application already runs on this cluster; stop its `kvmesh serve` first "
            f"(or `serve delete {APP_NAME}`)"
        )


def _deploy(config: ClusterConfig, redis_url: str, t0: float) -> str:
    """Deploy the application, reporting progress while Serve starts it; returns the ingress's node address.
    Every replica reads the index's URL (and its password) from its environment, never from its deployment's
    arguments."""
    from ray import serve

    from kvmesh.cluster.launch.app import build_app

    prepared = []
    if config.workers:
        _say(f"routing {len(config.workers)} external worker(s) of {config.name} (policy {config.policy}) ...")
    if config.replicas:
        prepared = prepare_nodes(config.model, config.engine.device, config.engine_actor_options, _say)
        _say(f"deploying {config.replicas} engine replica(s) of {config.model} (policy {config.policy}) ...")
    deployed = threading.Event()
    threading.Thread(target=_watch_deployments, args=(deployed, t0), daemon=True).start()
    try:
        app = build_app(config, serve_grpc=True, env={REDIS_URL_ENV: redis_url}, engine_nodes=max(1, len(prepared)))
        handle = serve.run(app, name=APP_NAME, route_prefix="/", logging_config={"log_level": "WARNING"})
    finally:
        deployed.set()
    return handle.node.remote().result()


def _start_serve(config: ClusterConfig) -> bool:
    """Start Ray Serve with this config's HTTP settings; True if this command started it. A Serve already
    running on the cluster with other HTTP settings would silently keep its own: that is an error."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        controller = None
    if controller is not None:
        http = ray.get(controller.get_http_config.remote())
        if (http.host, http.port) != (config.host, config.http_port):
            raise ClusterConflict(
                f"Ray Serve already runs on this cluster with HTTP on {http.host}:{http.port}, not "
                f"{config.host}:{config.http_port}; pass --host {http.host} --port {http.port}, or stop it first "
                "(serve shutdown)"
            )
    serve.start(http_options={"host": config.host, "port": config.http_port}, logging_config={"log_level": "WARNING"})
    return controller is None


def _wait_for_index(redis_url: str, config: ClusterConfig, timeout_s: float = 30.0) -> None:
    """Return once every engine replica has reported through the index; raise naming the index otherwise,
    so ``ready`` is never printed for a cluster whose routers would be blind."""
    import asyncio

    from kvmesh.router.prefix_index import PrefixIndex

    async def reporting() -> int:
        index = PrefixIndex(redis_url, APP_NAME, config.model, timeout_s=1.0)
        try:
            return len(await index.replica_reports())
        finally:
            await index.close()

    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        seen = asyncio.run(reporting())
        if seen >= config.engine_replicas:
            return
        time.sleep(0.25)
    raise ClusterConflict(
        f"only {seen} of {config.engine_replicas} engine replicas report through the index at {redacted(redis_url)} "
        f"after {timeout_s:.0f} s; see `kvmesh status` for the ones that cannot reach it"
    )


def _endpoints(config: ClusterConfig, ingress_node: str, redis_url: str) -> str:
    """Where clients reach the cluster: HTTP through Serve's proxy on the ingress's node (a proxy routes to
    the ingress on its own node, so a client there loses its connection with that node, loudly, instead of
    seeing a stream end early), gRPC on the ingress itself."""
    here = node_address()
    host = ingress_node if config.host == "0.0.0.0" else config.host
    where = f" on node {ingress_node} (the ingress's node)" if config.host != "0.0.0.0" and ingress_node != here else ""
    grpc = f"{host}:{config.grpc_port}{where}  (kvmesh.KVMesh, cluster/ingress/proto/kvmesh.proto)"
    return (
        f"  OpenAI HTTP  http://{host}:{config.http_port}/v1{where}  (metrics: /metrics, status: /status)\n"
        f"  gRPC         {grpc if config.grpc_port else 'off'}\n"
        f"  ingress      node {ingress_node}\n"
        f"  Redis index  {redacted(redis_url)}\n"
        "Press Ctrl-C to stop."
    )


def _shutdown(started_ray: bool, started_serve: bool, deployed_app: bool, redis: EmbeddedRedis | None) -> None:
    """Remove what this command started, in order: its app (replicas finish their streams and remove their
    index entries while Redis still runs), Serve, Ray, then Redis."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            if deployed_app:
                serve.delete(APP_NAME)
            if started_serve:
                serve.shutdown()
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
