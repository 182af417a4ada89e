"""What crosses a process boundary, as typed objects: one definition each, used by both sides of its hop.

- ``GenerateCall``: ingress -> engine deployment (``handle.generate.remote(call)``). The router on the
  handle reads its routing fields; the replica runs it.
- ``GenerateChunk``: engine replica -> ingress, one per step and sequence; the request's last chunk carries
  its ``Usage``, which is how the stream's end is known.
- ``LoadReport``: engine replica -> routers (Ray Serve's ``record_routing_stats``, which travels as a dict:
  ``as_dict`` / ``from_dict`` at that boundary only).
- ``KVPressure``: engine replica -> the autoscaling policy on Ray's controller (``record_autoscaling_stats``,
  a dict of numbers).
- ``ReplicaStatus``: engine replica -> Redis (JSON beside its heartbeat) -> ingress (metrics, ``/status``)
  -> ``kvmesh status`` (HTTP JSON).

Every message is keyword-only: fields are named where a message is built, so adding one cannot shift
another. Torch-free: the ingress, the routers and the autoscaler import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.defaults import DEFAULT_MEAN_OUTPUT_TOKENS, DEFAULT_STEP_S
from kvmesh.shared.hashing import BlockHash
from kvmesh.shared.sampling_params import SamplingParams


@dataclass(slots=True, kw_only=True)
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]
    """The prompt's full blocks, hashed once by the ingress (``kvmesh/shared/hashing.py``); the replica checks
    that they are its own before using them."""
    block_size: int
    params: SamplingParams = field(default_factory=SamplingParams)
    """Validated when built; the replica checks them again (a call may come from any handle user)."""
    session_id: str | None = None
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


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
class LoadReport:
    """What routers need to estimate a newcomer's wait on a replica, taken at ``reported_at`` (unix time)."""

    index_id: str
    reported_at: float = 0.0
    """Unix time the report was taken (0: unknown)."""
    pending_prefill_tokens: int = 0
    """Prompt tokens queued or mid-prefill."""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
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
    prefill_busy: float | None = None
    """Share of the last ``BUSY_WINDOW_S`` the replica spent prefilling (a moving average); None until measured."""
    step_s: float = DEFAULT_STEP_S
    mean_output_tokens: float = DEFAULT_MEAN_OUTPUT_TOKENS
    max_num_seqs: int = 256
    node: str = ""
    """The address of the Ray node the replica runs on."""
    index_error: str | None = None
    """Why the replica's last write to the index Redis failed (naming its address); None while it works.
    This report travels through Ray, so it reaches the ingress when Redis does not."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> LoadReport | None:
        """The report a replica sent, or None if it has not reported (or reported something else)."""
        if not values or "index_id" not in values:
            return None
        return cls(**{k: v for k, v in values.items() if k in _LOAD_REPORT_FIELDS})


_LOAD_REPORT_FIELDS = frozenset(f.name for f in dataclasses.fields(LoadReport))


@dataclass(slots=True, kw_only=True)
class KVPressure:
    """A replica's KV demand for the autoscaling policy (``kvmesh/cluster/autoscaling.py``), in blocks.

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
class EngineStats:
    """An engine's counters (``LLMEngine.stats``): what ``kvmesh status`` and the metrics show of it."""

    kv_usage: float = 0.0
    """Share of KV blocks pinned by requests (cached but evictable blocks count as free)."""
    prefix_hit_rate: float = 0.0
    """Prompt tokens served from the prefix cache over prompt tokens admitted, since start."""
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    num_swapped_out: int = 0
    """Preemptions that swapped the sequence to host memory instead of dropping its KV."""
    num_recomputed_tokens: int = 0
    """Computed tokens thrown away by preemptions that recompute."""
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    requests_admitted: int = 0
    """Requests admitted since start (each counted once, however often it was preempted)."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens of admitted requests, and those served from the prefix cache: a hit rate by tokens
    over any window is the ratio of their increments."""
    cached_prompt_tokens_host: int = 0
    """Of ``cached_prompt_tokens``, those loaded back from the host tier."""
    host_hit_rate: float = 0.0
    """Prompt tokens loaded from the host tier / admitted (included in ``prefix_hit_rate``)."""
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
    prefill_busy: float = 0.0
    """Share of the last ``BUSY_WINDOW_S`` spent prefilling: what routers price cache churn by."""


@dataclass(slots=True, kw_only=True)
class ReplicaStatus(EngineStats):
    """A replica's state for metrics and ``kvmesh status``: its engine's counters, its process and what its
    publisher adds at each heartbeat.

    Stored in Redis as JSON beside the heartbeat and served by the ingress's ``/status``: ``as_dict`` /
    ``from_dict`` at those edges. Fields a report lacks (an older replica's) read as their defaults."""

    pid: int | None = None
    node: str = ""
    """The address of the Ray node the replica runs on."""
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
    def from_dict(cls, values: dict[str, Any]) -> ReplicaStatus:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
