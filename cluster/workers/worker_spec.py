"""One external worker of a cluster (``workers:`` in the config, ``--worker`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One external worker: where it serves OpenAI HTTP and, optionally, publishes vLLM-style KV events."""

    url: str
    kv_events: str | None = None
    """Its PUB endpoint (``tcp://host:5557``); without it the router sees only its load."""
    replay: str | None = None
    topic: str = ""
    model: str | None = None
    """The name the worker serves (default: the cluster's ``served_model_name``)."""
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker url must start with http:// or https://, got {self.url!r}")
        for name in ("kv_events", "replay"):
            value = getattr(self, name)
            if value is not None and not _connectable(value):
                raise ValueError(f"worker {name} must be a ZMQ address (tcp://HOST:PORT or ipc://PATH), got {value!r}")

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """The CLI's ``URL[,kv_events=tcp://H:P][,replay=tcp://H:P][,topic=T][,model=M]``."""
        url, *rest = text.split(",")
        fields = {}
        for item in rest:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--worker {text!r}: expected key=value after the URL, got {item!r}")
            fields[key.strip()] = value.strip()
        try:
            return cls(url=url.strip(), **fields)
        except TypeError as exc:
            raise ValueError(f"--worker {text!r}: {exc}") from None


def distinct(specs: list[WorkerSpec]) -> list[WorkerSpec]:
    """``specs``, refused if two name the same URL: one engine would be priced, polled and followed twice."""
    seen: set[str] = set()
    for spec in specs:
        if spec.url.rstrip("/") in seen:
            raise ValueError(f"worker {spec.url} is named twice")
        seen.add(spec.url.rstrip("/"))
    return specs


def _connectable(address: str) -> bool:
    """Whether a router can connect a ZMQ socket to ``address``: ``tcp://`` with a host (not ``*``, which only
    binds) and a port, or ``ipc://`` with a path. ZMQ itself refuses the rest only once connecting."""
    if address.startswith("ipc://"):
        return len(address) > len("ipc://")
    if not address.startswith("tcp://"):
        return False
    try:
        parts = urlsplit(address)
        return bool(parts.hostname) and parts.hostname != "*" and parts.port is not None and not parts.path
    except ValueError:  # a port that is not a number in 0-65535
        return False
