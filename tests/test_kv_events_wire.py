"""vLLM's KV-event protocol: kvmesh's engine publishes it byte-compatibly, and kvmesh's consumer reads what real
vLLM (captured from its CPU build, ``tests/fixtures/kv_events/``) and SGLang publish, across gaps and restarts."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core.hashing import first_block_extra, hash_blocks, model_seed
from kvmesh.core.kv_event_wire import (
    AllCleared,
    EventBatch,
    KVEventsConfig,
    RemovedBlocks,
    StoredBlocks,
    WireFormatError,
    decode_batch,
    encode_batch,
)
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
from kvmesh.replica.kv_event_publisher import ZmqKVEventPublisher
from kvmesh.router.kv_event_subscriber import POLL_S, KVEventSubscriber
from kvmesh.router.worker_blocks import DEVICE, HOST, WorkerBlocks

FIXTURE = Path(__file__).parent / "fixtures" / "kv_events" / "vllm_cpu_0.32.0.json"
BLOCK, POOL = 4, 20
U64 = 1 << 64


def frames_of(messages: list[list[str]]) -> list[list[bytes]]:
    return [[base64.b64decode(f) for f in m] for m in messages]


@pytest.fixture(scope="module")
def vllm_capture() -> dict:
    return json.loads(FIXTURE.read_text())


# ---------------------------------------------------------------------------------------------- a strict reader
VLLM_FIELDS = {
    # vLLM 0.32's msgspec structs (vllm/distributed/kv_events.py): every field, each with the types it may take.
    "BlockStored": {
        "block_hashes": list,
        "parent_block_hash": (int, bytes, type(None)),
        "token_ids": list,
        "block_size": int,
        "lora_id": (int, type(None)),
        "medium": (str, type(None)),
        "lora_name": (str, type(None)),
        "extra_keys": (list, type(None)),
        "group_idx": (int, type(None)),
        "kv_cache_spec_kind": (str, type(None)),
    },
    "BlockRemoved": {"block_hashes": list, "medium": (str, type(None)), "group_idx": (int, type(None))},
    "AllBlocksCleared": {},
}


def strict_read(frames: list[bytes], topic: bytes) -> tuple[int, list[dict]]:
    """One published message as vLLM's schema defines it; raises AssertionError on any deviation."""
    assert len(frames) == 3, f"{len(frames)} frames"
    assert frames[0] == topic and len(frames[1]) == 8
    payload = msgpack.unpackb(frames[2], raw=False)
    assert isinstance(payload, list) and len(payload) in (2, 3) and isinstance(payload[0], float)
    for event in payload[1]:
        fields = VLLM_FIELDS[event["type"]]
        assert set(event) - {"type"} == set(fields), event.keys()
        for name, kind in fields.items():
            assert isinstance(event[name], kind), (name, event[name])
        if event["type"] == "BlockStored":
            n = len(event["block_hashes"])
            assert all(isinstance(h, int) and 0 <= h < U64 for h in event["block_hashes"])
            assert len(event["token_ids"]) == n * event["block_size"]
            assert event["medium"] in ("GPU", "CPU")
            assert len(event["extra_keys"]) == n
            assert all(
                k is None or (isinstance(k, list) and all(isinstance(x, str) for x in k)) for k in event["extra_keys"]
            )
    return int.from_bytes(frames[1], "big"), payload[1]


def test_our_fields_are_vllms_fields(vllm_capture):
    """Every event kind vLLM's CPU build published carries exactly the fields our reader (and encoder) use."""
    seen = set()
    for frames in frames_of(vllm_capture["replay_from_0"]):
        if frames[-1]:
            for event in msgpack.unpackb(frames[-1], raw=False)[1]:
                assert set(event) - {"type"} == set(VLLM_FIELDS[event["type"]])
                seen.add(event["type"])
    assert seen == set(VLLM_FIELDS)


# ---------------------------------------------------------------------------------------------- kvmesh publishes
@pytest.fixture
def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=POOL, max_num_batched_tokens=12)
    per_block = LLMEngine(config).bytes_per_block
    return LLMEngine(EngineConfig(**{**vars(config), "host_cache_bytes": 12 * per_block}))


def events_config(tmp_path: Path, name: str = "e") -> KVEventsConfig:
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/{name}.pub",
        replay_endpoint=f"ipc://{tmp_path}/{name}.replay",
        topic="kv@test",
    )


def run_prompts(engine: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> None:
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), cache_salt=salt)
    while engine.has_unfinished:
        engine.step()


def test_published_bytes_follow_vllms_schema(engine, tmp_path):
    config = events_config(tmp_path)
    pub = ZmqKVEventPublisher(config, BLOCK)
    engine.kv_event_sinks.append(pub.publish)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config.endpoint)
    time.sleep(0.2)
    run_prompts(engine, [list(range(100, 130)), list(range(100, 118)) + [7] * 9], salt="tenant-a")
    run_prompts(engine, [list(range(500 + 40 * i, 540 + 40 * i)) for i in range(3)])  # evictions, host tier
    assert engine.reset_prefix_cache()
    seqs, kinds, salted = [], set(), 0
    while sub.poll(1000):
        seq, events = strict_read(sub.recv_multipart(), b"kv@test")
        seqs.append(seq)
        kinds |= {(e["type"], e.get("medium")) for e in events}
        salted += sum(1 for e in events if e["type"] == "BlockStored" and e["extra_keys"][0] == ["tenant-a"])
    pub.close()
    sub.close()
    assert seqs == list(range(len(seqs))) and seqs
    assert {
        ("BlockStored", "GPU"),
        ("BlockRemoved", "GPU"),
        ("BlockStored", "CPU"),
        ("AllBlocksCleared", None),
    } <= kinds
    assert salted >= 1


# ---------------------------------------------------------------------------------------------- kvmesh consumes
def caught_up(sub: KVEventSubscriber, pub: ZmqKVEventPublisher, timeout: float = 10.0) -> bool:
    """The consumer applied every batch published, twice in a row 50 ms apart (the publisher thread may hold
    one it has taken from its queue)."""
    deadline, streak = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        last = -1 if sub.last_seq is None else sub.last_seq
        streak = streak + 1 if pub._queue.empty() and last == pub.next_seq - 1 else 0
        if streak == 2:
            return True
        time.sleep(0.05)
    return False


def consumer(config: KVEventsConfig, seed: bytes, drop_every: int = 0) -> tuple[KVEventSubscriber, WorkerBlocks]:
    blocks = WorkerBlocks(seed, BLOCK)
    sub = KVEventSubscriber(config.endpoint, config.replay_endpoint, blocks.apply, blocks.clear, topic=config.topic)
    if drop_every:  # lose live batches on purpose: the gaps must be replayed
        live, calls = sub._live, [0]

        def lossy(seq, payload):
            calls[0] += 1
            if calls[0] % drop_every:
                live(seq, payload)

        sub._live = lossy
    return sub.start(), blocks


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 30), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, drop_every=st.sampled_from([0, 3]))
def test_consumer_mirrors_the_engine_through_the_wire(engine, tmp_path_factory, ops, drop_every):
    """Random engine activity (prefix hits, evictions to the host tier and back, aborts, salted tenants): the
    consumer's kvmesh hashes per tier equal the engine's own cached sets, also when live batches are lost."""
    engine.kv_event_sinks[:] = []
    assert engine.reset_prefix_cache()  # hypothesis runs every example on this engine: start each empty
    config = events_config(tmp_path_factory.mktemp("ev"))
    pub = ZmqKVEventPublisher(config, BLOCK)
    engine.kv_event_sinks[:] = [pub.publish]
    sub, blocks = consumer(config, engine.hash_seed, drop_every)
    try:
        prefixes = [list(range(300, 300 + n)) for n in (0, 7, 13)]
        added = []
        for op in ops:
            if op[0] == "add":
                prompt = prefixes[op[1]] + [5000 + len(engine.requests) * 37 + i for i in range(op[2])]
                params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
                added.append(engine.add_request(prompt, params, cache_salt="t1" if op[3] else None))
            elif op[0] == "step":
                for _ in range(op[1]):
                    engine.step()
            elif added:
                engine.abort_request(added[op[1] % len(added)])
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.step()
        assert caught_up(sub, pub)
        assert set(blocks.snapshot(DEVICE)) == set(engine.pool.cached_hashes())
        assert set(blocks.snapshot(HOST)) == set(engine.swap.cached_hashes())
        if drop_every and pub.next_seq >= drop_every:
            assert sub.stats["replayed"] >= 1
    finally:
        sub.close()
        pub.close()


def test_late_consumer_and_publisher_restart(engine, tmp_path):
    """A consumer that joins late learns the cache from the replay buffer; a restarted publisher (its sequence
    starting over) makes it drop what it held and rebuild from the new stream."""
    config = events_config(tmp_path)
    pub = ZmqKVEventPublisher(config, BLOCK)
    engine.kv_event_sinks[:] = [pub.publish]
    run_prompts(engine, [list(range(100, 140))])
    sub, blocks = consumer(config, engine.hash_seed)
    try:
        assert caught_up(sub, pub)
        assert set(blocks.snapshot()) == set(engine.pool.cached_hashes()) != set()
        pub.close()
        assert engine.reset_prefix_cache()
        engine.kv_event_sinks[:] = []  # the restarted engine starts empty and publishes from sequence 0
        pub = ZmqKVEventPublisher(config, BLOCK)
        engine.kv_event_sinks[:] = [pub.publish]
        time.sleep(0.5)  # the consumer's socket reconnects (a real engine takes seconds to come back)
        run_prompts(engine, [list(range(900, 916))])  # one batch: seq 0 < the consumer's last
        assert caught_up(sub, pub)
        assert sub.stats["restarts"] == 1
        assert set(blocks.snapshot()) == set(engine.pool.cached_hashes())
        assert not set(blocks.snapshot()) & set(hash_blocks(list(range(100, 140)), BLOCK, engine.hash_seed))
    finally:
        sub.close()
        pub.close()


def test_idle_subscribers_stop_at_once(tmp_path):
    """A router follows one stream per worker and each sleeps up to ``POLL_S`` on a silent one: closing 16 of
    them (a router stopping) still takes well under one such wait, as ``close`` wakes each thread."""
    subs = [
        KVEventSubscriber(f"ipc://{tmp_path}/none{i}", None, lambda batch: None, lambda: None).start()
        for i in range(16)
    ]
    time.sleep(0.5)  # each thread is in its wait
    start = time.monotonic()
    for sub in subs:
        sub.close()
    assert time.monotonic() - start < POLL_S / 2
    assert not any(sub._thread.is_alive() for sub in subs)


def test_a_workers_event_stream_shows_in_its_status_and_metrics(engine, tmp_path):
    """An operator sees how a worker's events are followed: batches applied, gaps replayed, none lost, the lag,
    in the worker's status (``kvmesh status``) and as Prometheus counters."""
    from kvmesh.cluster.monitoring import metrics
    from kvmesh.cluster.workers.worker_client import Worker
    from kvmesh.cluster.workers.worker_spec import WorkerSpec

    config = events_config(tmp_path)
    pub = ZmqKVEventPublisher(config, BLOCK)
    engine.kv_event_sinks[:] = [pub.publish]
    sub, _ = consumer(config, engine.hash_seed, drop_every=2)
    worker = Worker(WorkerSpec(url="http://127.0.0.1:1"), "m", "m", BLOCK)
    try:
        assert worker.status().kv_event_batches is None  # no event stream followed: nothing to show
        worker.subscriber = sub
        run_prompts(engine, [list(range(100, 140))])
        assert caught_up(sub, pub)  # subscribed: what follows arrives live, every second batch dropped
        run_prompts(engine, [list(range(200 + 50 * i, 240 + 50 * i)) for i in range(4)])
        assert caught_up(sub, pub)
        status = worker.status()
        assert status.kv_event_batches == pub.next_seq >= 4  # every batch once: the dropped ones replayed
        assert status.kv_event_gaps >= 1 and status.kv_event_batches_lost == status.kv_event_restarts == 0
        assert 0 <= status.kv_event_lag_s < 5
        text = metrics.render({"w": status}).decode()
        assert f'kvmesh_replica_kv_event_batches_total{{replica="w"}} {float(pub.next_seq)}' in text
        assert f'kvmesh_replica_kv_event_gaps_total{{replica="w"}} {float(status.kv_event_gaps)}' in text
        assert 'kvmesh_replica_kv_event_batches_lost_total{replica="w"} 0.0' in text
        assert 'kvmesh_replica_kv_event_lag_seconds{replica="w"}' in text
    finally:
        worker.subscriber = None
        sub.close()
        pub.close()


# ---------------------------------------------------------------------------------------------- real vLLM bytes
def test_real_vllm_events_become_kvmesh_hashes(vllm_capture):
    """vLLM's CPU build (128-token blocks) as kvmesh's index sees it (16-token blocks): after every batch, the
    consumer holds exactly the 16-token hashes of the token prefixes of vLLM's cached blocks, salted ones
    with the salt; a reset empties it."""
    seed = model_seed("smollm2-135m")
    blocks = WorkerBlocks(seed, 16)
    prefixes: dict[int, tuple[list[int], str | None]] = {}  # engine hash -> whole token prefix, salt
    present: dict[int, int] = {}
    saw_salt = saw_removal = saw_clear = False
    replies = frames_of(vllm_capture["replay_from_0"])
    assert int.from_bytes(replies[-1][-2], "big", signed=True) == -1
    for frames in replies[:-1]:
        assert len(frames) == 4 and frames[0] == b"" and frames[1] == vllm_capture["topic"].encode()
        batch = decode_batch(frames[-1])
        blocks.apply(batch)
        for e in batch.events:
            if isinstance(e, StoredBlocks):
                assert e.block_size == vllm_capture["block_size"] == 128
                before, salt = prefixes[e.parent_block_hash] if e.parent_block_hash is not None else ([], e.cache_salt)
                saw_salt |= salt == "tenant-1"
                for i, h in enumerate(e.block_hashes):
                    prefixes[h] = (before + e.token_ids[: (i + 1) * 128], salt)
                    present[h] = present.get(h, 0) + 1
            elif isinstance(e, RemovedBlocks):
                saw_removal = True
                for h in e.block_hashes:
                    present[h] -= 1
            elif isinstance(e, AllCleared):
                saw_clear = True
                present.clear()
        expected = set()
        for h, copies in present.items():
            if copies:
                tokens, salt = prefixes[h]
                expected |= set(hash_blocks(tokens, 16, seed, first_block_extra(salt))[-8:])
        assert set(blocks.snapshot()) == expected
    assert saw_salt and saw_removal and saw_clear
    a = vllm_capture["prompts"]["A"]
    assert len(a) >= 256


def test_real_vllm_live_frames(vllm_capture):
    """The live stream: three frames (topic, 8-byte big-endian sequence, payload), sequence numbers rising
    by one, each payload a batch our decoder reads."""
    live = frames_of(vllm_capture["live"])
    seqs = [int.from_bytes(f[1], "big") for f in live]
    assert all(len(f) == 3 and f[0] == vllm_capture["topic"].encode() for f in live)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(decode_batch(f[2]).events for f in live)


# ---------------------------------------------------------------------------------------------- SGLang, errors
def test_sglang_encoding():
    """SGLang's documented shape: tagged arrays, signed int64 page hashes, ``CPU_PINNED`` for its host tier, the
    cache salt in a trailing metadata struct, and the rank as a third batch element."""
    tokens = list(range(32))
    payload = msgpack.packb(
        [
            1.5,
            [
                ["BlockStored", [-5, 7], None, tokens, 16, None, "GPU", ["tenant"]],
                ["BlockStored", [9], 7, list(range(32, 48)), 16, None, "CPU_PINNED"],
                ["BlockRemoved", [-5], "GPU"],
                ["BlockRemoved", [9]],
                ["AllBlocksCleared"],
                ["SomethingNew", 1, 2],
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0 and len(batch.events) == 5
    first, second, removed, bare, cleared = batch.events
    assert first.block_hashes == [-5, 7] and first.cache_salt == "tenant" and first.medium == "GPU"
    assert second.parent_block_hash == 7 and second.medium == "CPU_PINNED" and second.cache_salt is None
    assert removed == RemovedBlocks(block_hashes=[-5], medium="GPU") and bare.medium is None
    assert isinstance(cleared, AllCleared)
    blocks = WorkerBlocks(model_seed("m"), 16)
    changes = blocks.apply(EventBatch(1.0, batch.events[:2]))
    salted = hash_blocks(list(range(48)), 16, model_seed("m"), first_block_extra("tenant"))
    assert blocks.snapshot(DEVICE) == salted[:2] and blocks.snapshot(HOST) == salted[2:]
    assert [c.kind for c in changes] == ["stored"] * 3


def test_block_sizes_differ_both_ways():
    """Engine blocks larger than kvmesh's own several of them; smaller ones complete one every few; a block
    whose parent was never seen is skipped, with its children; two copies need two removals."""
    seed, tokens = model_seed("m"), list(range(64))
    want = hash_blocks(tokens, 16, seed)
    big = WorkerBlocks(seed, 16)
    big.apply(
        EventBatch(0, [StoredBlocks(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=32)])
    )
    assert big.snapshot() == want
    small = WorkerBlocks(seed, 16)
    pages = [
        StoredBlocks(
            block_hashes=[10 + i],
            parent_block_hash=(9 + i) if i else None,
            token_ids=tokens[8 * i : 8 * i + 8],
            block_size=8,
        )
        for i in range(8)
    ]
    small.apply(EventBatch(0, pages))
    assert small.snapshot() == want
    small.apply(
        EventBatch(0, [StoredBlocks(block_hashes=[17], parent_block_hash=16, token_ids=tokens[56:], block_size=8)])
    )
    small.apply(EventBatch(0, [RemovedBlocks(block_hashes=[17])]))
    assert small.snapshot() == want  # one copy of page 17 is left
    small.apply(EventBatch(0, [RemovedBlocks(block_hashes=[17])]))
    assert small.snapshot() == want[:3]
    orphan = StoredBlocks(block_hashes=[99], parent_block_hash=98, token_ids=tokens[:16], block_size=16)
    child = StoredBlocks(block_hashes=[100], parent_block_hash=99, token_ids=tokens[16:32], block_size=16)
    big.apply(EventBatch(0, [orphan, child]))
    assert big.snapshot() == want and big.unlinked == 2


def test_bad_payloads_are_refused_by_name():
    with pytest.raises(WireFormatError, match="msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(WireFormatError, match="token ids"):
        decode_batch(
            msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 16}]])
        )
    with pytest.raises(WireFormatError, match="int or bytes"):
        decode_batch(msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]))
    roundtrip = EventBatch(2.0, [RemovedBlocks(block_hashes=[3], medium="CPU"), AllCleared()], 1)
    assert decode_batch(encode_batch(roundtrip)) == roundtrip


def test_kv_events_config_is_vllms():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 100}'
    )
    assert config.enabled and config.for_rank(2).endpoint == "tcp://*:5559"
    assert config.for_rank(2).replay_endpoint == "tcp://*:5560"
    assert not KVEventsConfig.parse("{}").enabled
    with pytest.raises(ValueError, match="unknown kv events setting"):
        KVEventsConfig.parse('{"enable_kv_cache_event": true}')
    with pytest.raises(ValueError, match="ZMQ address"):
        KVEventsConfig.parse('{"endpoint": "localhost:5557"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{enable")
