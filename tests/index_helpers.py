"""Helpers for index tests: read back what Redis holds for a slot, run async lookups from sync tests."""

from __future__ import annotations

import asyncio

import redis

from kvmesh.router.prefix_index import IndexAnswer, PrefixIndex


def entries_of_slot(url: str, prefix: str, slot: bytes) -> set[bytes]:
    """Every 8-byte block key whose replica list contains ``slot``."""
    client = redis.Redis.from_url(url)
    out = set()
    for key in client.scan_iter(match=(prefix + "b:*").encode(), count=1000):
        bucket = key[len(prefix) + 2 :]
        for field, value in client.hgetall(key).items():
            if any(value[i : i + 4] == slot for i in range(0, len(value), 4)):
                out.add(bucket + field)
    client.close()
    return out


def host_tag(slot: bytes) -> bytes:
    """How a slot's host-tier entries are written: its top bit set (``router/index_schema.py``)."""
    return bytes([slot[0] | 0x80]) + slot[1:]


def disk_tag(slot: bytes) -> bytes:
    """How a slot's disk-tier entries are written: the bit below the top set."""
    return bytes([slot[0] | 0x40]) + slot[1:]


def query(url: str, deployment: str, model: str, chain, ids, **kw) -> IndexAnswer:
    """What the index answers for ``chain`` on a fresh connection. Its deadline is 2 s unless ``timeout_s`` is
    given: the router's own 20 ms (``PrefixIndex``'s default) covers a first call's connect and script load
    only on an idle machine, and a missed deadline answers None, which these tests would read as wrong
    contents."""
    kw.setdefault("timeout_s", 2.0)

    async def go():
        index = PrefixIndex(url, deployment, model, **kw)
        try:
            return await index.query(chain, ids)
        finally:
            await index.close()

    return asyncio.run(go())


def lookup(url: str, deployment: str, model: str, chain, ids, **kw) -> dict[str, int] | None:
    return query(url, deployment, model, chain, ids, **kw).device_hits
