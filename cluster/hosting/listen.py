"""Where a single-process server (``kvmesh engine``, ``kvmesh router``) listens.

The socket is bound before the model loads or a worker is contacted, so a port in use or out of range is an
error on the command line within a second, not a "ready" line followed by uvicorn's failure (or, for a port
out of range, by a server that never listens).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening); ``ValueError`` saying why it cannot be."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range (1-65535)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _freeze_start_up() -> None:
    """Move what start-up allocated (framework, tokenizer, model) out of the garbage collector's view: each
    collection then walks only what requests allocate, where it walked every start-up object too.
    ``gc.collect`` first, so no garbage is frozen."""
    gc.collect()
    gc.freeze()


def serve(app, sock: socket.socket, ready: str) -> None:
    """Serve the ASGI ``app`` on ``sock`` with uvicorn, printing ``ready`` first, until SIGINT or SIGTERM: then
    return normally (uvicorn shuts down gracefully and raises the signal again; ``uvicorn.run`` swallows it too)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    _freeze_start_up()
    print(ready, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])


def serve_all(apps: list[tuple[object, socket.socket]], ready: str) -> None:
    """Serve each ASGI app on its socket, all in this process, printing ``ready`` first, until SIGINT or SIGTERM;
    then return normally. Each uvicorn server takes the signals while it runs and, shut down, restores the
    handler before it and raises the signal again: the servers stop one after another, the first into a
    handler that ignores it."""
    if len(apps) == 1:
        return serve(*apps[0], ready)
    import uvicorn

    servers = [(uvicorn.Server(uvicorn.Config(app, log_level="warning")), sock) for app, sock in apps]

    async def run() -> None:
        await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in servers))

    _freeze_start_up()
    print(ready, flush=True)
    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        asyncio.run(run())
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
