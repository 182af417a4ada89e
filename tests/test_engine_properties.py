"""Random add / step / abort sequences (forks included) against a real (tiny) engine: accounting never breaks."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core.messages import BUSY_WINDOW_S, LoadReport
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
from kvmesh.replica.kv_events import AllBlocksCleared, BlockStored

BLOCK = 4
POOL = 24

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, 2),  # which shared prefix
            st.integers(1, 40),  # unique suffix length
            st.integers(1, 12),  # max_tokens
            st.integers(1, 3),  # n: parallel sampling forks share blocks copy-on-write
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("reset")),
    ),
    max_size=60,
)


@pytest.fixture(scope="module", params=[0, 10, 6], ids=["device-only", "host-tier", "disk-tier"])
def engine(request, tiny_llama_dir, tmp_path_factory):
    """The engine, alone or with a host prefix tier of ``param`` blocks (evictions and loads between tiers),
    and for the third a disk tier under it (host evictions written to files and read back)."""
    disk = str(tmp_path_factory.mktemp("disk")) if request.param == 6 else None

    def make(host_cache_bytes: int) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                block_size=BLOCK,
                num_kv_blocks=POOL,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                device="cpu",  # tiny blocks stress the scheduler; the CUDA kernels take 8 slots or more
                host_cache_bytes=host_cache_bytes,
                disk_cache_dir=disk if host_cache_bytes else None,
            )
        )

    engine = make(0)
    engine = make(request.param * engine.bytes_per_block) if request.param else engine
    yield engine
    engine.close()


class Mirror:
    """What a publisher would hold after replaying the engine's KV events, per medium."""

    def __init__(self, engine):
        self.hashes = set(engine.pool.cached_hashes())
        self.host = set(engine.swap.cached_hashes()) if engine.swap is not None else set()
        self.disk = set(engine.swap.disk.hashes()) if engine.swap is not None and engine.swap.disk else set()

    def apply(self, events):
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.hashes.clear()
                self.host.clear()
                self.disk.clear()
                continue
            held = {"device": self.hashes, "host": self.host, "disk": self.disk}[e.medium]
            if isinstance(e, BlockStored):
                assert e.block_hash not in held
                if e.medium != "disk":  # device and host: one at a time; the disk keeps its copy of either
                    assert e.block_hash not in self.hashes | self.host
                held.add(e.block_hash)
            else:
                held.remove(e.block_hash)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_workloads_keep_integrity(engine, ops):
    mirror = Mirror(engine)
    engine.kv_event_sinks[:] = [mirror.apply]
    prefixes = [list(range(100, 100 + n)) for n in (0, 9, 21)]
    added: list[str] = []
    counter = len(engine.requests)

    def check():
        engine.check_integrity()
        assert mirror.hashes == set(engine.pool.cached_hashes())
        assert mirror.host == (set(engine.swap.cached_hashes()) if engine.swap is not None else set())
        disk = engine.swap.disk if engine.swap is not None else None
        assert mirror.disk == (set(disk.hashes()) if disk is not None else set())

    for op in ops:
        if op[0] == "add":
            counter += 1
            prompt = prefixes[op[1]] + [1000 + counter * 50 + i for i in range(op[2])]
            params = SamplingParams(max_tokens=op[3], temperature=0, ignore_eos=True, n=op[4])
            added.append(engine.add_request(prompt, params))
        elif op[0] == "step":
            engine.step()
        elif op[0] == "abort" and added:
            engine.abort_request(added[op[1] % len(added)])
        elif op[0] == "reset":
            engine.reset_prefix_cache()  # refused while requests hold blocks
        check()
    for _ in range(2000):
        if not engine.has_unfinished:
            break
        engine.step()
        check()
    assert not engine.has_unfinished, "engine did not drain: deadlock"
    assert engine.pool.num_used == 0 and engine.pool.num_free == POOL
    assert not engine.requests
    disk = engine.swap.disk if engine.swap is not None else None
    if disk is not None:  # every block the tier lists is a whole file on disk, and nothing else is
        disk.flush()
        assert {p.stem for p in disk.dir.glob("*.kvb")} == {h.hex() for h in disk.hashes()}


def test_kv_exhaustion_completes_every_request_through_preemption(tiny_llama_dir):
    """64 concurrent long requests against a pool that holds about two of them at full length: every one
    completes with all its tokens, through preemption, and the pool's accounting holds after every step."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), block_size=16, num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=512
        )
    )
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ids = [engine.add_request([3000 + 97 * r + i for i in range(120)], params, f"long-{r}") for r in range(64)]
    produced = dict.fromkeys(ids, 0)
    finished: set[str] = set()
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            produced[out.request_id] += len(out.delta_token_ids)
            if out.finished:
                finished.add(out.request_id)
        engine.check_integrity()
        steps += 1
        assert steps < 50_000, "no progress"
    assert finished == set(ids) and set(produced.values()) == {64}
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to overflow"
    assert stats.num_free_blocks == stats.kv_total_blocks and stats.num_running == 0


def test_load_report_tells_routers_how_much_kv_room_a_newcomer_has(tiny_llama_dir):
    """Routers charge a prompt the wait for blocks on a replica whose pool cannot hold it: the report's
    free blocks are the pool's free (or evictable) blocks less what the queued prompts will take."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=24, max_num_seqs=16))

    def report():
        return LoadReport.of(engine.stats(), index_id="r")

    assert report().kv_free_blocks == 24 and report().kv_total_blocks == 24
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    engine.add_request([3000 + i for i in range(300)], params, "running")  # 19 blocks with its first token
    engine.step()
    engine.add_request([5000 + i for i in range(100)], params, "waiting")  # 7 blocks: does not fit beside it
    engine.step()
    assert report().num_running == 1 and report().num_waiting == 1
    assert report().kv_free_blocks == engine.pool.num_free - 7 < 0


def test_load_report_tells_routers_when_the_first_batch_slot_frees(tiny_llama_dir):
    """A full batch makes a newcomer wait for the soonest running sequence to end: the report's
    ``slot_free_steps`` is what ``max_tokens`` leaves a sequence that ignores EOS, and at most what the mean
    output length leaves one that may stop sooner."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=256, max_num_seqs=4))
    assert engine.stats().slot_free_steps is None
    engine.add_request([3000 + i for i in range(20)], SamplingParams(max_tokens=500, ignore_eos=True), "long")
    engine.step()
    engine.step()
    assert engine.stats().slot_free_steps == 498  # two tokens out
    engine.add_request([4000 + i for i in range(20)], SamplingParams(max_tokens=500), "may_stop")
    engine.step()
    mean = engine.stats().mean_output_tokens
    assert engine.stats().slot_free_steps == pytest.approx(min(497, max(mean - 1, 1.0)))


def test_load_report_tells_routers_how_busy_prefill_has_been(tiny_llama_dir):
    """Routers price cache churn by how busy the fleet's prefill is: a replica that only prefilled reports a
    share of the last window in proportion to the time it spent at it, and an idle one reports none."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=256, max_num_seqs=16))
    assert LoadReport.of(engine.stats(), index_id="r").prefill_busy == 0.0
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for r in range(8):
        engine.add_request([3000 + 97 * r + i for i in range(512)], params, f"p{r}")
        while engine.has_unfinished:
            engine.step()
    elapsed = time.perf_counter() - t0
    busy = LoadReport.of(engine.stats(), index_id="r").prefill_busy
    assert 0.3 * elapsed / BUSY_WINDOW_S < busy <= min(1.0, elapsed / BUSY_WINDOW_S)  # most of the time it ran


def test_each_step_is_timed_with_its_own_compute(tiny_llama_dir, monkeypatch):
    """On the CPU a step computes inside its launch while the step before is still to be collected: the
    prefill rate routers are told must divide a prefill by its own time, not by the step launched after it.
    Decode-only steps are made 0.3 s slower here (far above a warm 256-token prefill, even on a shared
    core); a prompt arrives alone, then one beside a decoding one."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_num_seqs=4))
    assert engine.async_scheduling
    engine.warm_up()  # kernels built: a cold first step is not what this test is about
    forward = engine.runner.forward

    def slow_decode(step, *args, **kwargs):
        if step.total == step.n:  # one token per sequence: a decode step
            time.sleep(0.3)
        return forward(step, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", slow_decode)
    timed = []
    observe = engine.rates.observe
    monkeypatch.setattr(
        engine.rates, "observe", lambda p, d, s, now=None: (timed.append((p, s)), observe(p, d, s, now))
    )
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request(list(range(3000, 3256)), params, "first")
    engine.step()
    engine.step()
    engine.add_request(list(range(5000, 5256)), params, "second")
    while engine.has_unfinished:
        engine.step()
    prefill = [s for p, s in timed if p]
    decode = [s for p, s in timed if not p]
    assert len(prefill) == 2 and len(decode) >= 2
    assert max(prefill) < 0.3 <= min(decode), timed


def test_warm_up_reports_a_prefill_rate_measured_after_the_first_cold_step(tiny_llama_dir, monkeypatch):
    """The first prefill of a fresh engine builds kernels; a replica that told routers that step's rate would
    look several times slower than it is until its moving average caught up. Here the first step is made
    to take 1 s longer: the rate after warm-up must be faster than that step's (on a busy machine the second
    step may be slow too, but not by a second)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=64, max_num_seqs=4))
    forward, calls, cold_s = engine.runner.forward, [], []

    def cold_first(step, *args, **kwargs):
        calls.append(step.total)
        if len(calls) > 1:
            return forward(step, *args, **kwargs)
        t0 = time.perf_counter()
        time.sleep(1.0)
        out = forward(step, *args, **kwargs)
        cold_s.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(engine.runner, "forward", cold_first)
    engine.warm_up()
    assert calls[0] > 64 and calls[1] == calls[0], "two prefills of the same shape"
    assert engine.rates.prefill_measured and engine.rates.prefill_tok_s > calls[0] / cold_s[0]
    assert engine.stats().num_free_blocks == 64 and not engine.has_unfinished
