"""One kvmesh engine as a serving unit (``EngineReplica``): the paged KV engine, its index publisher and its
vLLM-compatible KV events, behind ``generate(call)``. Ray Serve runs it as the engine deployment's replica
(``cluster/engines/engine_deployment.py``); ``kvmesh engine`` runs one in its own process without Ray, which
this module never imports (a replica learns its Serve identity only where Ray already runs).

Callers pass one ``GenerateCall`` per request carrying the token ids and the block hashes the ingress
computed once, so neither the router nor the replica re-tokenizes or re-hashes, and get a stream of
``GenerateChunk`` back. Under Serve a replica reports its ``LoadReport`` through Ray's
``record_routing_stats``, its ``KVPressure`` through ``record_autoscaling_stats`` and its ``ReplicaStatus``
beside its heartbeats, and mirrors its prefix cache into Redis under an id with a fresh incarnation.

A replica that cannot reach the index Redis fails its start, naming the address it tried and its node:
without the index it would serve, but every router would be blind to its cache. One that loses Redis later
keeps serving and says so in its load reports (``LoadReport.index_error``), which reach the ingress through
Ray, so ``/status`` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator

from kvmesh.cluster.hosting.nodes import available_cpus, claimed_cpus, node_address, replica_rank, replica_threads
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import InvalidRequest
from kvmesh.core.hashing import first_block_extra, hash_block, hash_blocks
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.messages import EngineStats, GenerateCall, GenerateChunk, KVFetch, LoadReport, ReplicaStatus, Usage
from kvmesh.replica import AsyncLLM
from kvmesh.replica.kv_event_publisher import ZmqKVEventPublisher
from kvmesh.replica.kv_peer import KVPeer
from kvmesh.replica.kv_scaling import hand_off, warm_up
from kvmesh.replica.lora_weights import LoRAError
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import index_redis_url, redacted
from kvmesh.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

FETCH_GRACE_S = 0.5
"""A prefix fetch may take this long beyond twice what recomputing the blocks would (then the rest is
recomputed): room for the holder's step to end before it exports."""
WARM_UP_S = 10.0
"""How long a starting replica pulls its peers' hottest blocks before it serves (its first request waits)."""
WARM_UP_SHARE = 0.25
"""Most of its pool a starting replica fills with its peers' hottest blocks."""
HAND_OFF_S = 5.0
"""How long a draining replica looks for peers to take its hottest blocks before it stops (in a rolling update
its replacements register while it drains; on a shutdown every peer drains too and none accepts)."""
INDEX_CONNECT_TIMEOUT_S = 15.0
"""How long a starting replica tries to publish its (empty) cache to the index before it gives up."""


class IndexUnreachable(RuntimeError):
    """The replica cannot write to the index Redis (the message names the address and this node)."""


class EngineReplica:
    def __init__(
        self,
        engine: EngineConfig,
        redis_url: str | None = None,
        deployment: str = "kvmesh",
        replicas_per_node: int = 1,
        kv_events: KVEventsConfig | None = None,
        rank_offset: int = 0,
        identity: tuple[str, object] | None = None,
        kv_host: str | None = None,
        kv_port: int = 0,
        prefill_replicas: int = 0,
        keep_kv: bool = True,
    ) -> None:
        """``engine`` unset ``torch_threads`` on a CPU: this replica's share of its node's cores, among
        ``replicas_per_node``. ``rank_offset``: replicas of the deployment ranked before this one that are not
        kvmesh engines (worker proxies, ``cluster/workers/mixed_deployment.py``); its KV-event ports count from
        the first engine. ``identity``: the Serve replica's id and rank, from the replica that runs this engine
        in an actor of its own (default: this process's Serve identity, ``serve_replica_identity``). ``kv_host``,
        ``kv_port``: where peers fetch this engine's KV blocks (default: this node's address, any free port).
        ``prefill_replicas``: replicas ranked below it only prefill for others (``LoadReport.role``).
        ``keep_kv``: start warm from the peers' hottest blocks and hand its own to them when drained."""
        self.node = node_address()
        if engine.torch_threads is None and engine.device in (None, "cpu"):
            threads = replica_threads(replicas_per_node, claimed_cpus(), available_cpus())
            engine = dataclasses.replace(engine, torch_threads=threads)
        self.llm = AsyncLLM.from_config(engine)
        self.engine = self.llm.engine
        self.engine.warm_up()  # measured decode costs for routers from the first request on
        name, rank = identity or serve_replica_identity()
        self.kv_events = self._kv_event_publisher(kv_events, replica_rank(rank) - rank_offset)
        self.role = "prefill" if rank is not None and replica_rank(rank) - rank_offset < prefill_replicas else "mixed"
        self.publisher = self._index_publisher(index_redis_url(redis_url), deployment, name)
        self.index_id = self.publisher.replica_id if self.publisher else name
        self._index_args = (index_redis_url(redis_url), deployment, self.engine.model_id)
        self._preemptions_seen = 0
        self.keep_kv = keep_kv
        host = kv_host or self.node
        self.peer = KVPeer(self.llm, host, kv_port, advertise=self.node if host in ("0.0.0.0", "::") else host)
        self._peer_start: asyncio.Task | None = None
        with contextlib.suppress(RuntimeError):  # under Serve the constructor runs on the replica's event loop
            self._peer_start = asyncio.get_running_loop().create_task(self.start_peer())

    async def start_peer(self) -> str:
        """Serve this engine's blocks to peers (``replica/kv_peer.py``), then, in a deployment with an index,
        pull the hottest blocks of the other replicas (a scale-up or restart starts warm); the address peers
        fetch from."""
        if self.peer.port or self.engine.config.simulate is not None:  # a simulated engine's blocks hold no bytes
            return self.peer.address if self.peer.port else ""
        address = await self.peer.start()
        log.info("replica %s serves its KV blocks at %s", self.index_id, address)
        peers = await self._peer_addresses() if self.keep_kv else []
        if peers:
            budget = int(self.engine.num_blocks * WARM_UP_SHARE)
            took = await warm_up(self.peer, peers, budget, WARM_UP_S)
            log.info("replica %s started warm: %d blocks from %d peers", self.index_id, took, len(peers))
        return address

    async def _peer_addresses(self) -> list[str]:
        """The KV addresses of the deployment's other live replicas, those caching most first (their statuses
        in the index's Redis); none without an index or when it cannot be read."""
        url, deployment, model = self._index_args
        if self.publisher is None or not url:
            return []
        index = PrefixIndex(url, deployment, model, timeout_s=2.0)
        try:
            reports = await index.replica_reports()
        except Exception as exc:  # peers are an optimisation: without them, start cold
            log.info("replica %s: no peer list (%r)", self.index_id, exc)
            return []
        finally:
            await index.close()
        peers = [r for rid, r in reports.items() if rid != self.index_id and r.kv_address and r.error is None]
        return [r.kv_address for r in sorted(peers, key=lambda r: -r.index_entries)]

    async def _hand_off_and_close(self) -> None:
        """Drain: the surviving replicas take this one's hottest blocks (within ``HAND_OFF_S``), then close."""
        try:
            if self.keep_kv and self._index_args[0] and self.publisher is not None:
                took = await hand_off(self.peer, self._peer_addresses, self.engine.num_blocks, HAND_OFF_S)
                log.info("replica %s handed %d blocks to its peers", self.index_id, took)
        finally:
            self.close()

    def _index_publisher(self, redis_url: str | None, deployment: str, name: str) -> KVIndexPublisher | None:
        """This engine's cache mirrored into the index (None without a Redis URL, here or in
        ``$KVMESH_REDIS_URL``); raises ``IndexUnreachable`` if the first sync does not land in time."""
        if not redis_url:
            return None
        swap = self.engine.swap
        publisher = KVIndexPublisher(
            redis_url,
            deployment,
            self.engine.model_id,
            name,
            self.engine.pool.cached_hashes,
            unique_name=True,
            status=self.status,
            host_snapshot=swap.cached_hashes if swap is not None else None,
            disk_snapshot=swap.disk.hashes if swap and swap.disk else None,
        ).start()
        if not publisher.wait_synced(INDEX_CONNECT_TIMEOUT_S):
            error = publisher.last_error or "no answer"
            publisher.close(remove_entries=False)
            raise IndexUnreachable(
                f"engine replica on node {self.node} cannot reach the index Redis at {redacted(redis_url)} "
                f"({error}); on a multi-node cluster the index must listen on an address every node reaches"
            )
        self.engine.kv_event_sinks.append(publisher.publish)
        return publisher

    def _kv_event_publisher(self, config: KVEventsConfig | None, number: int) -> ZmqKVEventPublisher | None:
        """vLLM-compatible KV events (``--kv-events-config``), ports offset by this engine's number."""
        if config is None or not config.enabled:
            return None
        publisher = ZmqKVEventPublisher(config.for_rank(number), self.engine.block_size)
        self.engine.kv_event_sinks.append(publisher.publish)
        return publisher

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        """Stream one request: a chunk per engine step and sequence (``index``: which of the request's ``n``
        sequences); the last one carries the request's ``Usage``."""
        params = dataclasses.replace(call.params)  # checked again (``__post_init__``): any handle user may call
        unfinished, completion_tokens = params.n, 0
        if self._peer_start is not None and not self._peer_start.done():  # starting warm: the first requests wait
            await asyncio.wait({self._peer_start}, timeout=WARM_UP_S + HAND_OFF_S)
        await self._ensure_adapter(call)
        hashes = self._checked_hashes(call)
        plan = (call.fetches or {}).get(self.index_id)
        cached_at_most = await self._fetch(plan, call, hashes) if plan is not None else call.num_tokens
        async for out in self.llm.generate(
            call.prompt_token_ids,
            params,
            request_id=call.request_id,
            cache_salt=call.cache_salt,
            block_hashes=hashes,
            lora_name=call.lora_name,
        ):
            completion_tokens += len(out.delta_token_ids)
            unfinished -= out.finished
            usage = None
            if not unfinished:
                usage = Usage(
                    prompt_tokens=call.num_tokens,
                    completion_tokens=completion_tokens,
                    cached_tokens=min(out.num_cached_tokens, cached_at_most),
                )
            yield GenerateChunk(
                index=out.index,
                text=out.delta_text,
                token_ids=out.delta_token_ids,
                finish_reason=out.finish_reason,
                num_cached_tokens=min(out.num_cached_tokens, cached_at_most),  # a peer computed the rest for it
                replica=self.index_id,
                usage=usage,
                logprobs=out.logprobs,
                prompt_logprobs=out.prompt_logprobs,
            )

    async def _ensure_adapter(self, call: GenerateCall) -> None:
        """Read the call's adapter from where the ingress recorded it if this engine does not serve it from
        there yet; ``InvalidRequest`` on ``model`` (a 400) if it cannot be served."""
        name, path, loras = call.lora_name, call.lora_path, self.engine.loras
        if name is None or path is None or (loras is not None and loras.path_of(name) == path):
            return
        try:
            await self.llm.between_steps(lambda: self.engine.ensure_lora(name, path))
        except LoRAError as exc:
            raise InvalidRequest(f"the adapter {name!r} cannot be served: {exc}", "model") from exc

    async def load_lora(self, name: str, path: str) -> str | None:
        """Read the PEFT adapter at ``path`` and serve it as ``name`` (a cluster's ``POST /v1/load_lora_adapter``
        loads it on the replica its router picks; the others read it on their first request for it). Why it
        cannot be served, or None."""
        try:
            await self.llm.between_steps(lambda: self.engine.load_lora(name, path))
        except LoRAError as exc:
            return str(exc)
        return None

    async def _fetch(self, plan: KVFetch, call: GenerateCall, hashes: list[bytes] | None) -> int:
        """Pull the prefix blocks the router planned from their holder (prefilled there first for a
        disaggregated request), within about twice what the router expected or recomputing them here would
        take, whichever is longer (a slower fetch is cut short: the rest is recomputed). The prompt tokens the
        usage may count as cached: all of them, or for a prefilled fetch, those before
        the first that was computed for this request (cache hits here or at the prefiller)."""
        ids, size = call.prompt_token_ids, self.engine.block_size
        if hashes is None:
            hashes = hash_blocks(ids, size, self.engine.hash_seed, first_block_extra(call.cache_salt, call.lora_name))
        recompute_s = plan.num_blocks * size / max(self.engine.rates.prefill_tok_s, 1.0)
        timeout_s = FETCH_GRACE_S + 2 * max(recompute_s, plan.expected_s)
        if not plan.prefill:
            salt, lora = call.cache_salt, call.lora_name
            await self.peer.fetch(plan, hashes, token_ids=ids, cache_salt=salt, lora_name=lora, timeout_s=timeout_s)
            return len(ids)
        local = self.peer.exchange.local_depth(hashes[: plan.num_blocks])
        computed = await self.peer.fetch_prefilled(plan, hashes, ids, call.cache_salt, timeout_s, call.lora_name)
        return max(local * size, len(ids) - computed)  # the prefiller had the prompt's first tokens cached

    def _checked_hashes(self, call: GenerateCall) -> list[bytes] | None:
        """The caller's block hashes if they are this engine's hashes of this prompt, else None (rehash).

        A wrong chain would make the prefix cache serve another prompt's KV, so the first and last blocks
        are recomputed (two block hashes, microseconds): they pin the seed, the tenant salt, the block size
        and, through the chain, every token."""
        hashes, ids, size = call.block_hashes, call.prompt_token_ids, self.engine.block_size
        if not hashes or call.block_size != size or len(hashes) != len(ids) // size:
            return None
        extra = first_block_extra(call.cache_salt, call.lora_name)
        first = hash_block(self.engine.hash_seed, ids[:size], extra)
        last_parent = hashes[-2] if len(hashes) > 1 else None
        last = hash_block(last_parent, ids[(len(hashes) - 1) * size : len(hashes) * size]) if last_parent else first
        if hashes[0] != first or hashes[-1] != last:
            log.warning("request %s: block hashes do not match this engine's; rehashing", call.request_id)
            return None
        return hashes

    def stats(self) -> EngineStats:
        """The engine's state with its KV transfers."""
        return self.peer.with_transfers(self.llm.stats())

    def status(self) -> ReplicaStatus:
        """The replica's state for metrics and ``kvmesh status`` (its publisher stores it with each heartbeat)."""
        address = self.peer.address if self.peer.port else None
        return ReplicaStatus.of(self.stats(), pid=os.getpid(), node=self.node, kv_address=address)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """``KVPressure`` for the autoscaler (``cluster/engines/autoscaling.py``), as the dict Ray takes;
        preemptions since the last report."""
        stats = self.llm.stats()
        pressure = stats.kv_pressure(self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        return pressure.as_dict()

    def record_routing_stats(self) -> dict:
        """The replica's ``LoadReport`` for routers (Ray passes it on as a dict)."""
        error = self.publisher.last_error if self.publisher is not None else None
        report = LoadReport.of(
            self.stats(),
            index_id=self.index_id,
            reported_at=time.time(),
            node=self.node,
            index_error=error,
            role=self.role,
            kv_address=self.peer.address if self.peer.port else None,
        )
        return report.as_dict()

    def close(self) -> None:
        """Stop the engine (drained by now: its disk tier keeps what it caches), take this replica's entries out
        of the index and close its KV-event sockets; once."""
        engine, publisher, kv_events = (getattr(self, name, None) for name in ("engine", "publisher", "kv_events"))
        self.engine = self.publisher = self.kv_events = None
        peer = getattr(self, "peer", None)
        if peer is not None:
            peer.stop()
        if engine is not None:
            engine.close()
        if publisher is not None:
            publisher.close()
        if kv_events is not None:
            kv_events.close()

    def __del__(self):
        """Serve awaits what a replica's destructor returns, on the replica's event loop (scale-down, redeploy,
        shutdown, after its streams drained): there the drain hands the hottest blocks to the surviving
        replicas first. Anywhere else (garbage collection) it just closes."""
        if getattr(self, "engine", None) is None:
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.close()
            return None
        return self._hand_off_and_close()


def serve_replica_identity() -> tuple[str, object]:
    """This Serve replica's unique id (a restarted replica is a new id; routers match on it) and its rank;
    outside Serve (``kvmesh engine``, tests) a fresh id per process and None. A process Ray never ran in has
    not imported it, and is not made to."""
    if "ray" in sys.modules:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        try:
            context = serve.get_replica_context()
            return context.replica_id.unique_id, context.rank
        except RayServeException:
            pass
    return f"engine-{uuid.uuid4().hex[:8]}", None
