"""How the global prefix index is laid out in Redis; shared by the lookup client and the publisher.

Memory is the constraint (millions of (block, replica) entries), so blocks are bucketed into Redis hashes
small enough to stay in Redis' compact listpack/ziplist encoding:

    <prefix>b:<2 bytes>    HASH  field <6 bytes> -> packed 4-byte slots of the replicas holding the block;
                           a slot with its top bit set holds it in that replica's host tier, not its device,
                           with the next bit in its disk tier
    <prefix>log:<slot>     STRING  every 8-byte block key the slot ever added (for purging it)
    <prefix>seq:<slot>     STRING  the number of the slot's last applied batch (a gap means Redis lost some)
    <prefix>hb:<id>        STRING  the replica's live slot, with a TTL: the heartbeat
    <prefix>st:<id>        STRING  the replica's status report (JSON: KV usage, hit rate, queues), same TTL
    <prefix>p:<8 bytes>    STRING  replica id a router just sent this block's request to (short TTL)
    <prefix>r:<worker url> ZSET  "<router id> <request id> <prefill tokens>" by unix time sent: what each
                           ``kvmesh router`` sharing the Redis sent the worker (``router/shared_routes.py``)
    <prefix>ss             HASH  replica id -> "<count> <seconds>": decaying count of conversations routers
                           started there (new conversations are placed with bounded loads)
    <prefix>reg / pending  HASH  replica id -> live slot / slot being resynchronised
    <prefix>slots          counter that allocates slots
    <prefix>meta           HASH  deployment and model names, for humans and `kvmesh status`
    <prefix>loras          HASH  LoRA adapter name -> directory, for adapters loaded at run time (every
                           ingress replica serves what one loaded)

A block key is the first 8 bytes of the block's 16-byte hash (2 bucket bytes + 6 field bytes): a collision
among a few million blocks is a ~1e-6 event and costs one mis-routed request, never a wrong answer (the
replica checks full hashes). A *slot* names one incarnation of one replica; every restart or
resynchronisation takes a fresh slot, so stale entries can never be attributed to a live replica. Slots
count up from 1, so the top two bits are free to mark the host and disk tiers (2^30 slots before they would
not be).
Redis never holds prompt text or pickled objects: only these bytes and replica ids.
"""

from __future__ import annotations

import os
from functools import cache
from importlib import resources
from urllib.parse import urlsplit, urlunsplit

import xxhash

from kvmesh.core.hashing import BlockHash

REDIS_URL_ENV = "KVMESH_REDIS_URL"
"""Where every process finds the index's Redis (its password included) when none is passed explicitly:
``kvmesh serve`` sets it for the processes it starts, Kubernetes from a Secret."""

KEY_BYTES = 8
DEFAULT_HEARTBEAT_TTL_S = 3.0
"""A replica beats every TTL/5; one silent for a whole TTL is dead to lookups and is purged."""


def index_redis_url(explicit: str | None = None) -> str | None:
    """The index's Redis URL: ``explicit`` if given, else ``$KVMESH_REDIS_URL``; None: no index."""
    return explicit or os.environ.get(REDIS_URL_ENV) or None


def redacted(url: str) -> str:
    """``url`` fit to print or log: a password in it is replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def index_prefix(deployment: str, model: str) -> str:
    """Namespace of one (deployment, model): two clusters or models can share a Redis without mixing."""
    return f"kvm:{xxhash.xxh3_64_hexdigest(f'{deployment}|{model}'.encode())[:10]}:"


def block_key(block_hash: BlockHash) -> bytes:
    return block_hash[:KEY_BYTES]


def probe_depths(n: int) -> list[int]:
    """The prefix depths (in blocks) at which routers record and look up where a prefix was just sent:
    1, 2, 4, ..., n. Siblings sharing any of them find the prefix before the replica's events arrive."""
    depths, d = [], 1
    while n > 0:
        depths.append(d)
        if d == n:
            break
        d = min(2 * d, n)
    return depths


def chain_arg(block_hashes: list[BlockHash]) -> bytes:
    return b"".join(h[:KEY_BYTES] for h in block_hashes)


@cache
def script_source(name: str) -> str:
    return resources.files("kvmesh.router").joinpath("lua", f"{name}.lua").read_text()
