"""Scaling that keeps KV: a replica that starts pulls its peers' hottest blocks, one that drains has the
others take its own. Both ride on ``KVPeer`` (``replica/kv_peer.py``): ``hot`` and ``take`` requests, then
ordinary fetches of separate blocks (not a prompt's chain)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.kv_peer import KVPeer

log = logging.getLogger(__name__)

HAND_OFF_POLL_S = 0.5
"""How often a draining replica with no peer to take its blocks looks for one again."""


async def warm_up(peer: KVPeer, peers: list[str], max_blocks: int, timeout_s: float) -> int:
    """Pull up to ``max_blocks`` of the hottest blocks of ``peers`` (KV addresses), in turn, within
    ``timeout_s`` in all (a replica starting up); how many blocks it adopted."""
    took, deadline = 0, time.monotonic() + timeout_s
    for address in peers:
        left = deadline - time.monotonic()
        if took >= max_blocks or left <= 0:
            break
        try:
            hot = [bytes.fromhex(h) for h in await peer.ask(address, {"hot": max_blocks - took}, left)]
        except (OSError, TimeoutError, ValueError) as exc:
            log.info("warm-up: %s gave no hot list: %r", address, exc)
            continue
        took += await peer.take(address, hot, max(deadline - time.monotonic(), 0.1))
    return took


async def hand_off(peer: KVPeer, peers: Callable[[], Awaitable[list[str]]], max_blocks: int, timeout_s: float) -> int:
    """Drain: have other replicas take this one's hottest blocks, split among those that accept (not
    draining themselves), asking ``peers()`` (their KV addresses) again while blocks are left and
    ``timeout_s`` has not passed (in a rolling update the replacements start while the old replicas
    drain); how many blocks they took."""
    peer.draining = True
    left = await peer.llm.between_steps(lambda: peer.engine.pool.hottest(max_blocks))
    deadline, took, refused = time.monotonic() + timeout_s, 0, set()
    while left and time.monotonic() < deadline:
        addresses = [a for a in await peers() if a not in refused]
        if not addresses:  # none yet (a replacement still loading) or all leaving: look again
            await asyncio.sleep(HAND_OFF_POLL_S)
            continue
        shares = [left[i :: len(addresses)] for i in range(len(addresses))]
        wait = max(deadline - time.monotonic(), 0.1)
        offers = [_offer(peer, a, share, wait) for a, share in zip(addresses, shares, strict=True)]
        answers = await asyncio.gather(*offers)
        left = [h for share, answer in zip(shares, answers, strict=True) if answer is None for h in share]
        refused |= {a for a, answer in zip(addresses, answers, strict=True) if answer is None}
        took += sum(answer for answer in answers if answer is not None)
        if left:
            await asyncio.sleep(HAND_OFF_POLL_S)
    return took


async def _offer(peer: KVPeer, address: str, hashes: list[BlockHash], timeout_s: float) -> int | None:
    """How many of ``hashes`` the peer at ``address`` took; None if it refused (draining) or failed."""
    request = {"take": {"address": peer.address, "hashes": [h.hex() for h in hashes]}}
    try:
        answer = await peer.ask(address, request, timeout_s)
    except (OSError, TimeoutError, ValueError) as exc:
        log.info("hand-off: %s took nothing: %r", address, exc)
        return None
    return None if answer.get("draining") else int(answer.get("took", 0))
