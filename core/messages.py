"""What crosses a process boundary, as typed objects: one definition each, used by both sides of its hop.

- ``GenerateCall``: ingress -> engine deployment (``handle.generate.remote(call)``). The router on the
  handle reads its routing fields; the replica runs it.
- ``GenerateChunk``: engine replica -> ingress, one per step and sequence; the request's last chunk carries
  its ``Usage``, which is how the stream's end is known.
- ``LoadReport``: engine replica -> routers (Ray Serve's ``record_routing_stats``, which travels as a dict:
  ``as_dict`` / ``from_dict`` at that boundary only; a ``kvmesh engine``'s ``GET /load`` and the ``LOAD_HEADER``
  of each of its responses, as JSON).
- ``KVPressure``: engine replica -> the autoscaling policy on Ray's controller (``record_autoscaling_stats``,
  a dict of numbers).
- ``ReplicaStatus``: engine replica -> Redis (JSON beside its heartbeat) -> ingress (metrics, ``/status``)
  -> ``kvmesh status`` (HTTP JSON).

Every message is keyword-only: fields are named where a message is built, so adding one cannot shift
another. Torch-free: the ingress, the routers and the autoscaler import it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.defaults import DEFAULT_MEAN_OUTPUT_TOKENS, DEFAULT_STEP_S
from kvmesh.core.hashing import BlockHash
from kvmesh.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]
    """The prompt's full blocks, hashed once by the ingress (``core/hashing.py``); the replica checks
    that they are its own before using them."""
    block_size: int
    params: SamplingParams = field(default_factory=SamplingParams)
    """Validated when built; the replica checks them again (a call may come from any handle user)."""
    session_id: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter the request runs on (the ``model`` it named); None: the base model. Part of its
    block hashes, as the cache salt is."""
    lora_path: str | None = None
    """Where the adapter's PEFT files lie, as the server that named it recorded them: a replica that has not
    loaded the adapter yet reads it from there, so an adapter is loaded where the router sends its requests."""
    fetches: dict[str, KVFetch] | None = None
    """Per candidate replica (index id), the prefix blocks it should pull from a peer before prefilling, as
    the router priced them; written by the router on the handle, read by the replica that runs the call."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True, kw_only=True)
class KVFetch:
    """Pull the first ``num_blocks`` blocks of a request's prefix from the peer at ``address`` before
    prefilling: the router found that cheaper than recomputing them. Advice only: a fetch that fails, is
    slow or brings bytes that fail a check is recomputed instead."""

    holder: str
    """The holder's index id."""
    address: str
    """Its KV transfer address (``LoadReport.kv_address``)."""
    num_blocks: int
    prefill: bool = False
    """The holder computes the prompt first (conditional disaggregation: prefilled there, decoded here)."""
    expected_s: float = 0.0
    """The router's estimate of the whole fetch, its prefill included: what the receiver waits for at most
    (twice this, or twice its own recompute, whichever is longer)."""


@dataclass(slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    """Counted once, whatever ``n``."""
    completion_tokens: int
    """Summed over the request's sequences."""
    cached_tokens: int
    """Prompt tokens served from the replica's prefix cache."""


@dataclass(slots=True, kw_only=True)
class TokenLogprob:
    """A token's log-probability under the model (raw logits: before ``logit_bias``, temperature and every
    cut, as vLLM reports them) and the ``top`` most likely alternatives, most likely first. None for a
    prompt's first token, which nothing before it scores."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class GenerateChunk:
    index: int
    """Which of the request's ``n`` sequences this continues."""
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """Set on the sequence's last chunk."""
    num_cached_tokens: int
    replica: str
    """The index id of the replica that produced it."""
    usage: Usage | None = None
    """Set on the request's last chunk (every sequence finished): the end of the stream."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``token_ids``, when the request asked for ``logprobs``."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On a sequence's first chunk, when the request asked for ``prompt_logprobs``: prompt tokens 1.."""


BUSY_WINDOW_S = 10.0
"""Time constant of a replica's moving average of how busy its prefill is (``LoadReport.prefill_busy``)."""


@dataclass(slots=True, kw_only=True)
class EngineLoad:
    """What an engine measures of its own load: the part of its state routers price a newcomer's wait with.
    ``LoadReport`` sends it to routers; ``EngineStats`` adds the engine's counters to it."""

    num_running: int = 0
    num_waiting: int = 0
    pending_prefill_tokens: int = 0
    """Prompt tokens queued or mid-prefill."""
    kv_usage: float = 0.0
    """Share of KV blocks pinned by requests (cached but evictable blocks count as free)."""
    kv_free_blocks: int | None = None
    """Blocks a newcomer could take once the queue ahead of it is admitted (free or evictable, less what
    queued prompts need)."""
    kv_total_blocks: int | None = None
    cache_fill: float = 1.0
    """Share of the pool holding pinned or cached blocks."""
    prefill_tok_s: float | None = None
    """Prefill tokens per second; None until measured (routers then assume the peers' median)."""
    decode_s_per_seq: float | None = None
    """Seconds one more running sequence adds to a decode step; None until measured."""
    host_load_tok_s: float | None = None
    """Prompt tokens per second the replica loads back from its host prefix tier (its measured copy
    bandwidth over the KV bytes per token); None without a host tier."""
    disk_load_tok_s: float | None = None
    """Prompt tokens per second the replica reads back from its disk tier and loads (its measured disk read
    and host copy bandwidths over the KV bytes per token); None without a disk tier."""
    fetch_tok_s: float | None = None
    """Prompt tokens per second of KV the replica pulls from a peer and adopts (its measured transfer rate over
    the KV bytes per token); None until it has fetched, or when it cannot (routers then assume no fetch)."""
    prefill_busy: float | None = None
    """Share of the last ``BUSY_WINDOW_S`` the replica spent prefilling (a moving average): what routers price
    cache churn by; None until measured."""
    step_s: float = DEFAULT_STEP_S
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS
    max_num_seqs: int = 256
    slot_free_steps: float | None = None
    """Decode steps until the first running sequence ends (when the batch is full, a newcomer's wait for a
    slot): the least expected remaining output among them; None when none runs."""
    loras: list[str] = field(default_factory=list)
    """LoRA adapters whose weights the engine holds ready, least recently used first: a request on any other
    first waits for its adapter to be read (``lora_load_s``)."""
    lora_slots: int = 0
    """How many adapters it holds ready at most (0: it serves none): one more read evicts the first of ``loras``."""
    lora_load_s: float | None = None
    """Seconds the engine took to read and place an adapter, measured (a moving average); None until it has."""


class MalformedReport(ValueError):
    """A report whose JSON does not fit its record: a missing field or a value of the wrong type."""


def checked_fields(cls: type, values: Any) -> dict[str, Any]:
    """``values``' entries that are fields of the dataclass ``cls``, each checked against the field's type (an
    int passes for a float); keys ``cls`` does not know are dropped (a newer sender's). Raises
    ``MalformedReport`` naming the field, so a reader logs a clear line instead of failing later."""
    if not isinstance(values, dict):
        raise MalformedReport(f"{cls.__name__}: expected a JSON object, got {type(values).__name__}")
    hints = _field_types(cls)
    for name, value in values.items():
        if name in hints and not _conforms(value, hints[name]):
            raise MalformedReport(f"{cls.__name__}.{name}: {value!r} is not {hints[name]}")
    missing = [name for name in _required(cls) if name not in values]
    if missing:
        raise MalformedReport(f"{cls.__name__}: missing {', '.join(missing)}")
    return {name: value for name, value in values.items() if name in hints}


@functools.cache
def _required(cls: type) -> tuple[str, ...]:
    no_default = dataclasses.MISSING
    return tuple(f.name for f in dataclasses.fields(cls) if f.default is no_default and f.default_factory is no_default)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits ``hint`` (the field types these records use: scalars, optionals, lists,
    mappings and records of them)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        _, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_conforms(v, item) for v in value.values())
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return True  # Any


LOAD_HEADER = "x-kvmesh-load"
"""The response header in which a ``kvmesh engine`` sends its ``LoadReport`` (JSON) with each generation, taken
as the response starts: routers read every worker they send to without polling it."""


@dataclass(slots=True, kw_only=True)
class LoadReport(EngineLoad):
    """What routers need to estimate a newcomer's wait on a replica, taken at ``reported_at`` (unix time):
    its engine's load and where it runs."""

    index_id: str
    reported_at: float = 0.0
    """Unix time the report was taken (0: unknown)."""
    node: str = ""
    """The address of the Ray node the replica runs on."""
    index_error: str | None = None
    """Why the replica's last write to the index Redis failed (naming its address); None while it works.
    This report travels through Ray, so it reaches the ingress when Redis does not."""
    role: str = "mixed"
    """``mixed`` (prefills and decodes) or ``prefill`` (a dedicated prefill replica: routers send it no
    request, only prefills that another replica then fetches and decodes)."""
    kv_address: str | None = None
    """Where peers pull this replica's KV blocks (``tcp://host:port``, ``replica/kv_transfer.py``); None
    when it serves none."""
    lora_served: list[str] | None = None
    """The only LoRA adapters this replica can serve (an external worker's ``/v1/models``); None: any adapter a
    call names (a kvmesh engine reads it from the call's ``lora_path``)."""

    @classmethod
    def of(cls, load: EngineLoad, **where: Any) -> LoadReport:
        """The report of an engine whose state is ``load`` (an ``EngineStats`` too); ``where``: the fields of
        its own (``index_id``, ``reported_at``, ``node``, ``index_error``, ``role``, ``kv_address``)."""
        return cls(**{f.name: getattr(load, f.name) for f in dataclasses.fields(EngineLoad)}, **where)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None, sender: str = "a replica") -> LoadReport | None:
        """The report ``sender`` sent, or None if it has not reported (or reported something else). A report
        with a field of the wrong type is refused with a log line naming the sender and the field: routers
        then price that replica as unreported instead of failing on it later."""
        if not values or "index_id" not in values:
            return None
        try:
            return cls(**checked_fields(cls, values))
        except MalformedReport as exc:
            log.warning("ignoring a malformed load report from %s: %s", sender, exc)
            return None


@dataclass(slots=True, kw_only=True)
class KVPressure:
    """A replica's KV demand for the autoscaling policy (``cluster/engines/autoscaling.py``), in blocks.

    Sent through Ray's ``record_autoscaling_stats`` (a dict of numbers: ``as_dict``); Ray averages each field
    per replica over its look-back window and hands the policy one dict per field (``per_replica``)."""

    kv_used_blocks: float
    """Blocks pinned by requests (evictable cached blocks are free capacity, not demand)."""
    kv_waiting_blocks: float
    """Blocks the waiting requests' prompts will need."""
    kv_total_blocks: float
    num_running: float
    num_waiting: float
    preemptions: float
    """Preemptions since the replica's previous report."""

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, float]) -> KVPressure | None:
        """The pressure a replica reported, or None if a field is missing (it reported something else)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if any(name not in values for name in names):
            return None
        return cls(**{name: values[name] for name in names})

    @classmethod
    def per_replica(cls, aggregated: dict[str, dict[Any, float]]) -> list[KVPressure]:
        """Each replica's pressure from Ray's aggregated metrics (field -> replica -> value)."""
        replicas = {replica for values in aggregated.values() for replica in values}
        reports = (cls.from_dict({k: v[r] for k, v in aggregated.items() if r in v}) for r in replicas)
        return [report for report in reports if report is not None]


@dataclass(slots=True, kw_only=True)
class EngineStats(EngineLoad):
    """An engine's state at one moment (``LLMEngine.stats``), read once: its load and its counters. The
    routers' ``LoadReport``, the autoscaler's ``KVPressure`` and the ``ReplicaStatus`` of ``kvmesh status``
    and the metrics are all derived from it."""

    waiting_blocks: int = 0
    """Blocks the waiting requests' tokens will need."""
    num_free_blocks: int = 0
    """Blocks an allocation may take: empty plus evictable cached ones."""
    num_cached_blocks: int = 0
    """Evictable blocks holding cached prefixes."""
    num_preemptions: int = 0
    num_swapped_out: int = 0
    """Preemptions that swapped the sequence to host memory instead of dropping its KV."""
    num_recomputed_tokens: int = 0
    """Computed tokens thrown away by preemptions that recompute."""
    requests_admitted: int = 0
    """Requests admitted since start (each counted once, however often it was preempted)."""
    lora_reads: int = 0
    """LoRA adapters read from their files since start (loaded, or read again after leaving memory)."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens of admitted requests, and those served from the prefix cache: a hit rate by tokens
    over any window is the ratio of their increments."""
    cached_prompt_tokens_host: int = 0
    """Of ``cached_prompt_tokens``, those loaded back from the host tier."""
    host_tier_blocks: int = 0
    """Host-tier blocks set aside for evicted prefix blocks (0: no host prefix tier)."""
    host_tier_used_blocks: int = 0
    disk_tier_blocks: int = 0
    """Blocks the disk tier's directory may hold (0: no disk tier)."""
    disk_tier_used_blocks: int = 0
    disk_blocks_read: int = 0
    """Blocks read back from the disk tier since start (each one a block not recomputed)."""
    disk_blocks_dropped: int = 0
    """Blocks the disk tier did not keep since start: its write queue was full (a disk slower than evictions)
    or their write failed (a full disk)."""
    kv_fetches: int = 0
    """Prefix fetches from peers since start (``replica/kv_peer.py``), and what they brought and took."""
    kv_prefills: int = 0
    """Prompts this replica prefilled for a peer that decoded them (conditional disaggregation)."""
    kv_fetched_blocks: int = 0
    kv_fetched_bytes: int = 0
    kv_fetch_seconds: float = 0.0
    kv_served_blocks: int = 0
    """Blocks (and bytes) this replica sent to peers since start."""
    kv_served_bytes: int = 0
    kv_fetch_fallbacks: dict[str, int] = field(default_factory=dict)
    """Fetches that fell back to recompute, by reason (timeout, unreachable, holder_lost, refused, foreign,
    corrupt, wrong_chain, malformed, no_room)."""

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens admitted, since start."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """Prompt tokens loaded from the host tier over admitted (included in ``prefix_hit_rate``)."""
        return self.cached_prompt_tokens_host / self.prompt_tokens if self.prompt_tokens else 0.0

    def kv_pressure(self, preemptions_seen: int = 0) -> KVPressure:
        """For the autoscaler: blocks pinned by requests (evictable cached ones are free capacity, not demand),
        blocks the waiting prompts will need, the pool, the queue, and the preemptions since the count
        ``preemptions_seen``."""
        return KVPressure(
            kv_used_blocks=(self.kv_total_blocks or 0) - self.num_free_blocks,
            kv_waiting_blocks=self.waiting_blocks,
            kv_total_blocks=self.kv_total_blocks or 0,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            preemptions=self.num_preemptions - preemptions_seen,
        )


@dataclass(slots=True, kw_only=True)
class ReplicaStatus(EngineStats):
    """A replica's state for metrics and ``kvmesh status``: its engine's counters, its process and what its
    publisher adds at each heartbeat.

    Stored in Redis as JSON beside the heartbeat and served by the ingress's ``/status``: ``as_dict`` /
    ``from_dict`` at those edges. Fields a report lacks (an older replica's) read as their defaults."""

    pid: int | None = None
    node: str = ""
    """The address of the Ray node the replica runs on."""
    kv_address: str | None = None
    """Where peers fetch its KV blocks (``LoadReport.kv_address``): how a starting or draining replica finds
    the others."""
    index_entries: int = 0
    """Blocks the replica has published to the index (set by its publisher)."""
    reported_at: float = 0.0
    """Unix time of the heartbeat that stored it (set by its publisher)."""
    index_resyncs: int = 0
    """Times its publisher rebuilt its index entries whole (at start, after a queue overflow, a Redis error
    or restart, a prefix-cache reset), since start (set by its publisher)."""
    index_replayed_batches: int = 0
    """Batches its publisher sent again because Redis had lost them after acknowledging them."""
    index_errors: int = 0
    """Redis calls of its publisher that failed (each retried until Redis answers)."""
    kv_event_batches: int | None = None
    """An external worker's KV-event batches applied, replays included; None: no event stream is followed (a
    kvmesh replica, a worker without ``kv_events``)."""
    kv_event_gaps: int = 0
    """Times batches were missing from the worker's live stream (each asked for again from its replay socket)."""
    kv_event_batches_lost: int = 0
    """Missing batches the worker's replay buffer no longer held: its cache view may lack them until it changes."""
    kv_event_restarts: int = 0
    """Times the worker's event stream started over (a restarted engine): its cache view was rebuilt."""
    kv_event_lag_s: float | None = None
    """Seconds from the worker's timestamp of its last batch to that batch being applied here."""
    error: str | None = None
    """Why the replica could not read its engine's state; its counters are then unknown, not zero."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, stats: EngineStats, **process: Any) -> ReplicaStatus:
        """The status of a replica whose engine is at ``stats``; ``process``: the fields of its own."""
        return cls(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(EngineStats)}, **process)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ReplicaStatus:
        """A stored or served status (fields a report lacks, an older replica's, read as their defaults); raises
        ``MalformedReport`` for a field of the wrong type."""
        return cls(**checked_fields(cls, values))


@dataclass(slots=True, kw_only=True)
class RoutingCount:
    """How many requests one routing policy placed for one reason (``Decision.reason``)."""

    policy: str
    reason: str
    count: int


@dataclass(slots=True, kw_only=True)
class IndexCutOff:
    """A replica that serves but cannot write to the index (its load reports say so through Ray)."""

    node: str
    error: str


@dataclass(slots=True, kw_only=True)
class RedisHealth:
    """The index Redis as one ingress sees it."""

    ok: bool
    ping_ms: float | None = None
    used_memory: str | None = None
    error: str | None = None


@dataclass(slots=True, kw_only=True)
class IndexSize:
    entries: int
    """(block, replica) entries the replicas have published."""


@dataclass(slots=True, kw_only=True)
class ClusterStatus:
    """What ``/status`` answers (the ingress's and ``kvmesh router``'s alike, built in one place:
    ``HttpApi.status``) and ``kvmesh status`` shows: ``as_dict`` / ``from_dict`` at that HTTP edge."""

    model: str
    policy: str
    replicas: dict[str, ReplicaStatus]
    decisions: list[RoutingCount]
    index: IndexSize
    live_replicas: int | None
    """Engine replicas (or workers) the routers of this process see alive; None before any router exists here
    (the first request creates it)."""
    redis: RedisHealth | None = None
    """None: this server routes without Redis (``kvmesh router``, ``kvmesh engine``)."""
    index_unreachable: dict[str, IndexCutOff] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> ClusterStatus:
        """The status a server answered; raises ``MalformedReport`` naming what does not fit."""
        v = checked_fields(cls, values)
        redis = v.get("redis")
        return cls(
            model=v["model"],
            policy=v["policy"],
            replicas={rid: ReplicaStatus.from_dict(r) for rid, r in v["replicas"].items()},
            decisions=[RoutingCount(**checked_fields(RoutingCount, d)) for d in v["decisions"]],
            index=IndexSize(**checked_fields(IndexSize, v["index"])),
            live_replicas=v["live_replicas"],
            redis=None if redis is None else RedisHealth(**checked_fields(RedisHealth, redis)),
            index_unreachable={
                rid: IndexCutOff(**checked_fields(IndexCutOff, c)) for rid, c in v.get("index_unreachable", {}).items()
            },
        )
