"""The ecosystem's KV-event wire format (vLLM's, which SGLang, Dynamo, llm-d and Ray's router read too).

An engine publishes one *batch* per step over ZMQ: three frames, ``topic``, an 8-byte big-endian sequence
number (one per batch, from 0) and a msgpack payload ``[ts, events, data_parallel_rank]`` (the rank omitted
when unset). Each event is a map tagged by ``type`` (vLLM since mid-2026) or an array whose first element is
the tag (vLLM before, SGLang): ``BlockStored`` (a run of full blocks: their hashes, the parent of the first,
their tokens, the block size, LoRA, ``medium``, ``extra_keys`` with block 0's cache salt), ``BlockRemoved``
and ``AllBlocksCleared``. Hashes are u64 ints (vLLM's builtin hash, SGLang's signed int64) or raw bytes
(vLLM's sha256); consumers never recompute them, they hash ``token_ids`` themselves and use the engine's
hashes only to link parents and apply removals. The decoder takes fields that are missing as unset and
ignores unknown fields and trailing array elements, so older and newer publishers stay readable.

This module holds the typed events, ``KVEventsConfig`` (vLLM's ``--kv-events-config`` JSON, same keys) and
the msgpack encoding and decoding; the sockets live in ``replica/kv_event_publisher.py`` and
``router/kv_event_subscriber.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack

WireHash = int | bytes
"""An engine's name for a block: only compared, never recomputed."""

GPU, CPU = "GPU", "CPU"
"""``medium`` values: the device pool and the host tier. SGLang's host tier says ``CPU_PINNED``."""
HOST_MEDIA = frozenset({CPU, "CPU_PINNED"})
END_SEQ = -1
"""The sequence number of a replay's end marker."""


class WireFormatError(ValueError):
    """A payload that is not a KV-event batch of a known shape (what it is, in the message)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredBlocks:
    """``BlockStored``: full blocks now cached, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    """Block 0's tenant salt: vLLM carries it in ``extra_keys``, SGLang as ``cache_salt`` or ``metadata``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RemovedBlocks:
    """``BlockRemoved``: one copy each of these blocks left ``medium``."""

    block_hashes: list[WireHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllCleared:
    """``AllBlocksCleared``: the engine dropped every cached block (a prefix-cache reset)."""


WireEvent = StoredBlocks | RemovedBlocks | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``: the same JSON keys and defaults. ``endpoint`` with ``*`` binds, an
    address without one connects; several engines of one process offset the ports by their rank."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv events {name} must be a ZMQ address (tcp://HOST:PORT), got {value!r}")
        if self.buffer_steps < 1 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("kv events buffer_steps and max_queue_size must be >= 1, hwm >= 0")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str | dict) -> KVEventsConfig:
        """From the CLI's JSON (or a config file's mapping); unknown keys are refused by name."""
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown kv events setting(s) {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config for the ``rank``-th engine sharing it: TCP ports offset by the rank, as vLLM does for
        data-parallel ranks, so replicas on one host never collide."""
        if not rank:
            return self
        return replace(
            self, endpoint=offset_port(self.endpoint, rank), replay_endpoint=offset_port(self.replay_endpoint, rank)
        )


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` with its TCP port moved up by ``rank`` (other transports get a suffix)."""
    if endpoint is None or not rank:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_{rank}"


# ---------------------------------------------------------------------------------------------- encoding
def encode_batch(batch: EventBatch) -> bytes:
    """vLLM 0.32's payload, field for field (``tests/fixtures/kv_events/``): ``[ts, events]`` (+ the rank when
    set), each event a ``type``-tagged map; block 0's salt in ``extra_keys``; one KV cache group (index 0) of
    full attention, which is what kvmesh engines have."""
    events = [_event_map(e) for e in batch.events]
    body: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def _event_map(event: WireEvent) -> dict:
    if isinstance(event, StoredBlocks):
        lora = [event.lora_name] if event.lora_name is not None else []  # vLLM: the adapter in every block's keys
        extra: list[Any] = [lora or None for _ in event.block_hashes]
        if event.cache_salt is not None and event.parent_block_hash is None:
            extra[0] = [*lora, event.cache_salt]
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "extra_keys": extra,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, RemovedBlocks):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


# ---------------------------------------------------------------------------------------------- decoding
_STORED_ARRAY = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
"""Positions every array-form ``BlockStored`` shares (vLLM, SGLang); vLLM then adds ``lora_name`` and
``extra_keys``, SGLang a ``metadata`` struct."""
_REMOVED_ARRAY = ("block_hashes", "medium")


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its msgpack payload, in any of the shapes the module docstring lists."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireFormatError(f"payload is not msgpack: {exc!r}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise WireFormatError(f"a batch is [ts, events, rank], got {type(raw).__name__}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireFormatError("a batch needs a numeric ts and a list of events")
    return EventBatch(float(ts), [e for e in map(_decode_event, events) if e is not None], rank)


def _decode_event(raw: Any) -> WireEvent | None:
    """One event; None for an event type this consumer does not know (newer publishers)."""
    if isinstance(raw, dict):
        tag, values = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": (*_STORED_ARRAY, "lora_name", "extra_keys"), "BlockRemoved": _REMOVED_ARRAY}
        values = dict(zip(names.get(tag, ()), raw[1:], strict=False))
        if tag == "BlockStored" and len(raw) == 8 and isinstance(raw[7], dict | list):
            values = {**values, "lora_name": None, "extra_keys": None, "metadata": raw[7]}  # SGLang's extension
    else:
        raise WireFormatError(f"an event is a tagged map or array, got {raw!r:.80}")
    if tag == "BlockStored":
        return _stored(values)
    if tag == "BlockRemoved":
        return RemovedBlocks(block_hashes=_hashes(values.get("block_hashes")), medium=values.get("medium"))
    if tag == "AllBlocksCleared":
        return AllCleared()
    return None


def _stored(v: dict) -> StoredBlocks:
    hashes, tokens, size = _hashes(v.get("block_hashes")), v.get("token_ids"), v.get("block_size")
    if not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
        raise WireFormatError("BlockStored needs token_ids and a positive block_size")
    if len(tokens) != len(hashes) * size:
        raise WireFormatError(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    parent = v.get("parent_block_hash")
    return StoredBlocks(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=tokens,
        block_size=size,
        lora_id=v.get("lora_id"),
        medium=v.get("medium"),
        lora_name=v.get("lora_name"),
        cache_salt=_salt(v),
    )


def _salt(v: dict) -> str | None:
    """Block 0's cache salt: SGLang's ``cache_salt`` (top level or in ``metadata``), else the text in vLLM's
    ``extra_keys[0]`` that is not the LoRA name (vLLM puts LoRA, multimodal and salt keys there, in that order)."""
    if isinstance(v.get("cache_salt"), str):
        return v["cache_salt"]
    meta = v.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("cache_salt"), str):
        return meta["cache_salt"]
    if isinstance(meta, list) and meta and isinstance(meta[0], str):
        return meta[0]
    extra = v.get("extra_keys")
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], list | tuple):
        return None
    texts = [k for k in extra[0] if isinstance(k, str) and k != v.get("lora_name")]
    return texts[-1] if texts else None


def _hashes(raw: Any) -> list[WireHash]:
    if not isinstance(raw, list) or not raw:
        raise WireFormatError("an event needs a non-empty list of block_hashes")
    return [_hash(h) for h in raw]


def _hash(raw: Any) -> WireHash:
    if isinstance(raw, bool) or not isinstance(raw, int | bytes):
        raise WireFormatError(f"a block hash is an int or bytes, got {type(raw).__name__}")
    return raw


def wire_hash(block_hash: bytes) -> int:
    """kvmesh's 16-byte block hash as the u64 the wire carries (its first 8 bytes, as the index keys it)."""
    return int.from_bytes(block_hash[:8], "big")
