"""Pure-logic pieces of the front door: request translation, configuration, status rendering, gRPC stubs,
and the ingress's promises (no torch; hashes the replica accepts only when they are its own)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.cluster.launch.config import ClusterConfig, build_config
from kvmesh.cluster.monitoring.status import render_status
from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.openai_requests import ChatCompletionRequest, CompletionRequest
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import InvalidRequest
from kvmesh.core.messages import ClusterStatus, GenerateCall, GenerateChunk, KVPressure, TokenLogprob, Usage
from kvmesh.core.sampling_params import SamplingParams


def test_chat_request_translates_to_sampling_params():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0,
            "top_k": -1,
            "stop": "END",
            "presence_penalty": 0,  # unknown to us, sent by many clients: ignored
        }
    )
    params = req.check()
    assert (params.max_tokens, params.temperature, params.top_k, params.stop) == (7, 0, 0, ["END"])
    assert req.messages[0].render() == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"response_format": {"type": "grammar"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 100, "max_tokens": 10}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_unsupported_or_out_of_range_fields_are_400s(fields, param):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    with pytest.raises(APIError) as err:
        req.check()
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_defaults_clients_send_are_accepted_and_vllm_extensions_honoured():
    """What the OpenAI SDK and agent frameworks send when nothing is asked for is not refused."""
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": False,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "modalities": ["text"],
            "logit_bias": {"42": -100, "7": 2.5},
            "min_tokens": 3,
            "stop_token_ids": [9],
        }
    )
    params = req.check()
    assert params.logit_bias == {42: -100, 7: 2.5} and params.min_tokens == 3 and params.stop_token_ids == [9]
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 1, "echo": False})
    assert completion.check().logit_bias == {} and completion.check().logprobs is None
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 3}).check().logprobs == 3
    for bad in (6, True):
        with pytest.raises(APIError) as err:
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": bad}).check()
        assert err.value.param == "logprobs"
    chat_lp = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    assert ChatCompletionRequest.model_validate(chat_lp).check().logprobs == 0
    assert ChatCompletionRequest.model_validate({**chat_lp, "top_logprobs": 20}).check().logprobs == 20
    echo = {"model": "m", "prompt": "x", "echo": True}
    assert CompletionRequest.model_validate(echo).check().prompt_logprobs is None  # text only
    assert CompletionRequest.model_validate({**echo, "logprobs": 2}).check().prompt_logprobs == 2
    with pytest.raises(APIError) as err:
        CompletionRequest.model_validate({**echo, "suffix": "y"}).check()
    assert err.value.param == "suffix"


def test_n_choices_are_shaped_by_index_and_gathered_from_interleaved_chunks():
    import asyncio

    from kvmesh.cluster.ingress.generation import gather
    from kvmesh.cluster.protocol.openai_responses import ResponseShape, usage_dict

    assert CompletionRequest(model="m", prompt="x", n=3).check().n == 3
    chat = ResponseShape("chatcmpl-1", chat=True, model="m", n=3)
    whole = chat.whole(
        ["a", "b", "c"],
        ["stop", "length", "stop"],
        usage_dict(Usage(prompt_tokens=5, completion_tokens=9, cached_tokens=0)),
    )
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "a", "stop"),
        (1, "b", "length"),
        (2, "c", "stop"),
    ]
    assert whole["usage"]["total_tokens"] == 14
    assert chat.chunk("x", index=2)["choices"][0] == {
        "index": 2,
        "delta": {"content": "x"},
        "finish_reason": None,
        "logprobs": None,
    }
    text = ResponseShape("cmpl-1", chat=False, model="m", n=2).whole(
        ["p", "q"], ["stop", "stop"], usage_dict(Usage(prompt_tokens=1, completion_tokens=2, cached_tokens=0))
    )
    assert [(c["index"], c["text"]) for c in text["choices"]] == [(0, "p"), (1, "q")]

    async def chunks():
        pieces = [(1, "b", None), (0, "a", None), (1, "B", "stop"), (0, "A", "length")]
        for i, (index, piece, reason) in enumerate(pieces):
            usage = Usage(prompt_tokens=1, completion_tokens=4, cached_tokens=0) if i == 3 else None
            yield GenerateChunk(
                index=index,
                text=piece,
                token_ids=[7],
                finish_reason=reason,
                num_cached_tokens=0,
                replica="r",
                usage=usage,
            )

    texts, reasons, last, logprobs = asyncio.run(gather(2, chunks()))
    assert (texts, reasons, last.text, logprobs) == (["aA", "bB"], ["length", "stop"], "A", [None, None])


def test_engine_replica_streams_each_sequence_with_its_index(tiny_llama_dir):
    import asyncio

    from kvmesh.cluster.engines.engine_replica import EngineReplica

    server = EngineReplica(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    call = GenerateCall(
        request_id="r",
        prompt_token_ids=list(range(100, 137)),
        block_hashes=[],
        block_size=16,
        params=SamplingParams(max_tokens=4, temperature=0, n=3),
    )

    async def collect():
        return [chunk async for chunk in server.generate(call)]

    chunks = asyncio.run(collect())
    assert sorted(c.index for c in chunks) == [0] * 4 + [1] * 4 + [2] * 4
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert chunks[-1].finish_reason == "length"
    assert [c.usage is not None for c in chunks] == [False] * 11 + [True]  # the last one ends the stream
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (37, 12)
    server.engine.check_integrity()
    assert server.engine.pool.num_used == 0
    # What it reports beside the stream, typed at both ends: its status and its KV pressure.
    status, stats = server.status(), dataclasses.asdict(server.engine.stats())
    del stats["prefill_busy"]  # a moving average: it decays between the two reads
    assert status.as_dict().items() >= stats.items() and stats["requests_admitted"] >= 1
    assert (status.pid, status.num_running, status.kv_total_blocks, status.error) == (os.getpid(), 0, 64, None)
    pressure = KVPressure.from_dict(server.record_autoscaling_stats())
    assert pressure == KVPressure(
        kv_used_blocks=0, kv_waiting_blocks=0, kv_total_blocks=64, num_running=0, num_waiting=0, preemptions=0
    )

    # The replica checks a call's parameters again: a handle user may have changed them after building them.
    call.params.top_p = 5.0
    with pytest.raises(InvalidRequest) as err:
        asyncio.run(collect())
    assert err.value.param == "top_p"
    assert not server.engine.has_unfinished


def test_messages_cross_a_pickle_as_ray_sends_them():
    params = SamplingParams(max_tokens=3, stop=["END"], logit_bias={5: -100.0})
    call = GenerateCall(request_id="r", prompt_token_ids=[1, 2], block_hashes=[b"h" * 16], block_size=16, params=params)
    chunk = GenerateChunk(
        index=0,
        text="x",
        token_ids=[7],
        finish_reason="stop",
        num_cached_tokens=0,
        replica="r0",
        usage=Usage(prompt_tokens=2, completion_tokens=1, cached_tokens=0),
        logprobs=[TokenLogprob(token_id=7, logprob=-0.5, top=[(7, -0.5)])],
    )
    for message in (call, chunk):
        assert pickle.loads(pickle.dumps(message)) == message
    assert isinstance(pickle.loads(pickle.dumps(call)).params, SamplingParams)
    with pytest.raises(TypeError):
        GenerateCall("r", [1, 2], [], 16)  # keyword-only: a positional build cannot shift a field


def test_completion_prompt_forms():
    assert CompletionRequest(model="m", prompt=["one"]).single_prompt() == "one"
    assert CompletionRequest(model="m", prompt=[5, 6]).single_prompt() == [5, 6]
    assert CompletionRequest(model="m", prompt="x").check().max_tokens == 16  # OpenAI's default
    with pytest.raises(APIError):
        CompletionRequest(model="m", prompt=["a", "b"]).single_prompt()
    with pytest.raises(APIError):
        CompletionRequest(model="m", prompt="").single_prompt()


def test_config_layers_defaults_file_and_flags(tmp_path: Path):
    file = tmp_path / "cluster.yaml"
    file.write_text("replicas: 3\npolicy: pow2\nengine:\n  block_size: 32\n  max_num_seqs: 4\n")
    config = build_config(file, {"replicas": 5, "policy": None, "engine": {"max_num_seqs": 8}})
    assert (config.replicas, config.policy) == (5, "pow2")
    assert (config.engine.block_size, config.engine.max_num_seqs, config.engine.model) == (32, 8, config.model)
    assert config.engine == EngineConfig(model=config.model, block_size=32, max_num_seqs=8)
    assert build_config().replicas == ClusterConfig().replicas


def test_autoscaling_settings_from_file_and_flags(tmp_path: Path):
    file = tmp_path / "cluster.yaml"
    file.write_text("replicas: 2\nmax_replicas: 6\nautoscaling:\n  downscale_delay_s: 120\n  upscale_delay_s: 9\n")
    config = build_config(file, {"target_kv_util": 0.5, "autoscaling": {"upscale_delay_s": 2}})
    scaling = config.autoscaling_config()
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (1, 6, 2)
    assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"]) == (2, 120)
    assert scaling["policy"]["policy_kwargs"] == {"target_kv_util": 0.5}
    # Threads are shared among the most replicas a node may hold, so a scaled-out node is not oversubscribed;
    # each replica counts its own node's cores (a 12-core node here), unless it claimed CPUs from Ray.
    from kvmesh.cluster.hosting.nodes import replica_threads

    assert config.engine.torch_threads is None
    assert (config.replicas_per_node(1), config.replicas_per_node(2), config.replicas_per_node(4)) == (6, 3, 2)
    assert replica_threads(config.replicas_per_node(1), None, cores=12) == 2
    assert replica_threads(config.replicas_per_node(2), 0.0, cores=12) == 4
    assert replica_threads(6, 3.0, cores=12) == 3  # what it claimed
    assert replica_threads(6, None, cores=2) == 1
    assert build_config().autoscaling_config() is None  # no max_replicas: a fixed size
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        build_config(overrides={"min_replicas": 3, "max_replicas": 2})


def test_threads_follow_a_containers_cpu_quota_not_the_nodes_cores(tmp_path: Path):
    from kvmesh.cluster.hosting.nodes import available_cpus

    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")  # a pod limited to 2.5 CPUs
    assert available_cpus(cpu_max) == min(3, len(os.sched_getaffinity(0)))
    cpu_max.write_text("max 100000\n")  # no limit
    assert available_cpus(cpu_max) == len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_app_builder_takes_the_redis_url_from_the_environment(monkeypatch):
    from kvmesh.cluster.launch.app import app_builder
    from kvmesh.router.index_schema import REDIS_URL_ENV

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(ValueError, match=REDIS_URL_ENV):
        app_builder({"replicas": 1})
    monkeypatch.setenv(REDIS_URL_ENV, "redis://:s3cret-pw@kvmesh-redis:6379/0")
    from ray.serve._private.build_app import build_app

    built = build_app(app_builder({"replicas": 1, "max_replicas": 2}), name="kvmesh")
    # Every process reads the URL from its own environment: the password is in no deployment argument.
    for d in built.deployments:
        seen = f"{d.init_args!r} {d.init_kwargs!r} {d._deployment_config!r} {d.ray_actor_options!r}"
        assert "s3cret-pw" not in seen and "kvmesh-redis" not in seen, d.name


@pytest.mark.parametrize(
    "text, message",
    [
        ("replica: 2\n", "unknown settings"),
        ("policy: magic\n", "unknown routing policy"),
        ("policy_kwargs:\n  sesion_balance: 1.5\n", "sesion_balance.*it takes .*session_balance"),
        ("policy_kwargs:\n  session_balance: 0.5\n", "session_balance must be"),
        ("policy_kwargs: [1]\n", "policy_kwargs must be a mapping"),
        ("replicas: 0\n", "at least 1"),
        ("engine:\n  block_size: 12\n", "power of two"),
        ("engine:\n  blocksize: 16\n", "engine:"),
        ("- 1\n", "mapping"),
    ],
)
def test_config_errors_name_the_problem(tmp_path: Path, text: str, message: str):
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_config(file)


def test_status_table_lists_replicas_and_decisions():
    status = {
        "model": "m",
        "policy": "kv_aware",
        "index": {"entries": 12},
        "live_replicas": 2,
        "redis": {"ok": True, "ping_ms": 0.2, "used_memory": "1M"},
        "replicas": {
            "r1": {
                "kv_usage": 0.5,
                "prompt_tokens": 64,
                "cached_prompt_tokens": 16,
                "num_running": 2,
                "num_waiting": 1,
                "num_preemptions": 0,
                "prefill_busy": 0.0,
                "index_entries": 12,
                "node": "198.18.0.2",
            },
            "r2": {
                "kv_usage": 0.75,
                "prompt_tokens": 64,
                "cached_prompt_tokens": 32,
                "cached_prompt_tokens_host": 8,
                "host_tier_used_blocks": 30,
                "host_tier_blocks": 200,
                "disk_tier_used_blocks": 7,
                "disk_tier_blocks": 900,
                "num_running": 1,
                "num_waiting": 0,
                "num_preemptions": 3,
                "prefill_busy": 0.625,
                "index_entries": 40,
                "kv_fetches": 2,
                "kv_fetched_blocks": 18,
                "kv_served_blocks": 5,
                "kv_fetch_fallbacks": {"timeout": 1},
            },
        },
        "decisions": [{"policy": "kv_aware", "reason": "hit", "count": 9}],
    }
    rows = [line.split() for line in render_status(ClusterStatus.from_dict(status)).splitlines()]
    assert ["r1", "198.18.0.2", "50.0%", "25.0%", "off", "off", "off", "2", "1", "0", "0%", "-", "12"] in rows
    moved = ["18/5", "(1", "fell", "back)"]  # KV blocks fetched from / sent to peers
    assert ["r2", "?", "75.0%", "50.0%", "12.5%", "30/200", "7/900", "1", "0", "3", "62%", *moved, "40"] in rows
    assert ["kv_aware", "hit", "9"] in rows and rows[0][7:9] == ["Redis", "ok,"]
    down = {**status, "replicas": {}, "decisions": [], "redis": {"ok": False}, "live_replicas": 0}
    down = render_status(ClusterStatus.from_dict(down))
    assert "Redis DOWN" in down and "no replica reports" in down and "no routing decisions" in down
    assert "no live engine replica" in down
    # A replica that lost the index still reports through Ray: status names it beside "Redis ok".
    cut = {"r3": {"node": "198.18.0.3", "error": "ConnectionError('refused') at 198.18.0.1:6390"}}
    text = render_status(ClusterStatus.from_dict({**status, "index_unreachable": cut}))
    assert "(not from 1 replica(s))" in text.splitlines()[0]
    assert "replica r3 on 198.18.0.3 cannot reach the index: ConnectionError('refused') at 198.18.0.1:6390" in text


def test_committed_grpc_stubs_match_the_proto(tmp_path: Path):
    from kvmesh.cluster.ingress.proto.build import build

    build(tmp_path)
    committed = Path(__file__).resolve().parents[1] / "cluster" / "ingress" / "proto"
    for name in ("kvmesh_pb2.py", "kvmesh_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            "rerun python -m kvmesh.cluster.ingress.proto.build"
        )


def test_ingress_never_imports_torch(smollm_dir):
    """Nor do the processes that only route: ``kvmesh router`` and Serve's proxies of external workers, in a
    deployment of their own or mixed with kvmesh's engines (whose actors load it)."""
    code = (
        "import sys, kvmesh.cluster.ingress.deployment\n"
        "import kvmesh.cluster.workers.router_server, kvmesh.cluster.workers.worker_proxy\n"
        "import kvmesh.cluster.workers.mixed_deployment\n"
        "from kvmesh.core.model_files import apply_chat_template, load_tokenizer\n"
        f"tok = load_tokenizer(__import__('pathlib').Path({str(smollm_dir)!r}))\n"
        "assert apply_chat_template(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_engine_accepts_only_its_own_block_hashes(tiny_llama_dir):
    from kvmesh.cluster.engines.engine_replica import EngineReplica
    from kvmesh.core.hashing import first_block_extra, hash_blocks, model_seed

    server = EngineReplica(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    ids = list(range(100, 180))  # 5 full blocks
    seed = model_seed(str(tiny_llama_dir))

    def body(hashes, block_size=16, salt=None):
        return GenerateCall(
            request_id="r", prompt_token_ids=ids, block_hashes=hashes, block_size=block_size, cache_salt=salt
        )

    good = hash_blocks(ids, 16, seed, first_block_extra("tenant-a"))
    assert server._checked_hashes(body(good, salt="tenant-a")) == good
    assert server._checked_hashes(body(good, salt="tenant-b")) is None  # another tenant's chain
    assert server._checked_hashes(body(hash_blocks(ids, 16, model_seed("other")))) is None
    assert server._checked_hashes(body(good[:-1], salt="tenant-a")) is None
    tampered = [*good[:-1], good[0]]
    assert server._checked_hashes(body(tampered, salt="tenant-a")) is None
    assert server._checked_hashes(body(hash_blocks(ids, 32, seed), block_size=32)) is None


def test_the_ingress_fetches_no_weights_from_the_hub(monkeypatch, tmp_path: Path):
    import huggingface_hub

    from kvmesh.core.model_files import resolve_model_dir

    asked = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo, allow_patterns: asked.append(allow_patterns) or str(tmp_path)
    )
    resolve_model_dir("org/some-model", weights=False)
    resolve_model_dir("org/some-model")
    assert "*.safetensors" not in asked[0] and "tokenizer*" in asked[0] and "*.json" in asked[0]
    assert "*.safetensors" in asked[1]


def test_a_model_the_hub_does_not_give_is_named_with_what_was_tried():
    """A mistyped model name: the error says what kvmesh looked for (aliases, paths, the hub), not only the
    hub's own message (here the hub is unreachable; with a network it answers that no such repository exists)."""
    from kvmesh.core.model_files import resolve_model_dir

    with pytest.raises(FileNotFoundError, match=r"'kvmesh-tests/smolm2-135m' is not a known alias .*smollm2-135m"):
        resolve_model_dir("kvmesh-tests/smolm2-135m")


def test_a_long_prompt_is_tokenized_off_the_event_loop(smollm_dir):
    """Tokenizing a long prompt must not stall the ingress's other streams: the event loop keeps ticking
    while it runs (the tokenizer releases the GIL in its worker thread). Tokenized on the loop, it would be
    stalled the whole time; here at most half of it, which leaves room for the odd long pause a busy machine
    or a garbage collection of this test process's heap (holding the GIL for its own reasons) can add."""
    import asyncio
    import gc
    import time

    from kvmesh.cluster.ingress.generation import Generation
    from kvmesh.core.model_files import load_tokenizer

    generation = object.__new__(Generation)
    generation.tokenizer = load_tokenizer(smollm_dir)
    text = "the router keeps prefixes warm " * 30_000

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        ids = await generation.encode(text, add_special_tokens=True)
        took = time.perf_counter() - t0
        done.set()
        await task
        return took, gaps, ids

    gc.collect()  # not mid-measurement: a full collection holds the GIL whichever thread runs it
    took, gaps, ids = asyncio.run(main())
    stalled = sum(g for g in gaps if g > 0.05)
    assert ids == generation.tokenizer.encode(text)
    assert took > 0.1 and len(gaps) >= 10 and stalled < took / 2, (took, stalled, max(gaps, default=0.0), len(gaps))


def test_a_retry_cancels_the_first_attempt_and_uses_a_fresh_request_id(monkeypatch):
    """A replica that fails before the first token is retried; the first attempt is cancelled (a replica
    that is in fact alive must not generate for nobody) and the retry carries a new engine request id (the
    same replica would refuse a repeated one)."""
    import asyncio

    from ray.exceptions import ActorUnavailableError

    import kvmesh.cluster.ingress.generation as generation_module
    from kvmesh.cluster.ingress.deployment import RAY_HANDLE_ERRORS
    from kvmesh.cluster.ingress.generation import Generation, ModelLimits, Prepared, new_request_id

    monkeypatch.setattr(generation_module, "RETRY_BACKOFF_S", 0.0)

    class Attempt:
        def __init__(self, fail: bool) -> None:
            self.fail, self.cancelled = fail, False

        def cancel(self) -> None:
            self.cancelled = True

        async def __aiter__(self):
            if self.fail:
                raise ActorUnavailableError("connection lost", None)
            yield GenerateChunk(
                index=0,
                text="x",
                token_ids=[5],
                finish_reason="length",
                num_cached_tokens=0,
                replica="r0",
                usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=0),
            )

    class Handle:
        def __init__(self) -> None:
            self.calls, self.attempts = [], []

        def options(self, **_) -> Handle:
            return self

        def remote(self, call: GenerateCall) -> Attempt:
            self.calls.append(call)
            self.attempts.append(Attempt(fail=len(self.attempts) == 0))
            return self.attempts[-1]

    handle = Handle()
    limits = ModelLimits({"m"}, "m", vocab_size=100, max_model_len=64, max_prompt_bytes=1000, max_n=4)
    generation = Generation(handle, tokenizer=None, model="m", block_size=16, limits=limits, errors=RAY_HANDLE_ERRORS)
    request_id = new_request_id(chat=False)
    params = SamplingParams(max_tokens=1)
    call = GenerateCall(
        request_id=request_id, prompt_token_ids=[1, 2, 3], block_hashes=[], block_size=16, params=params
    )
    prep = Prepared(call, params, chat=False, api="completions")

    async def run():
        return [chunk async for chunk in generation.stream(prep)]

    chunks = asyncio.run(run())
    assert chunks[-1].usage.completion_tokens == 1
    first, second = handle.attempts
    assert first.cancelled and not second.cancelled
    ids = [c.request_id for c in handle.calls]
    assert len(set(ids)) == 2 and ids[0] == request_id


def test_the_routers_wait_long_enough_for_a_busy_replicas_probe(monkeypatch):
    """The KV-aware routers live in the ingress processes; Ray's 0.1 s probe deadline, missed by a busy CPU
    replica, sends a request past the replica holding its prefix. The ingress gets 0.5 s unless told."""
    from ray.serve._private.build_app import build_app

    from kvmesh.cluster.launch.app import app_builder
    from kvmesh.cluster.launch.config import PROBE_DEADLINE_ENV
    from kvmesh.router.index_schema import REDIS_URL_ENV

    monkeypatch.setenv(REDIS_URL_ENV, "redis://127.0.0.1:1/0")

    def ingress_deadline() -> str:
        built = build_app(app_builder({"replicas": 1}), name="kvmesh")
        (ingress,) = [d for d in built.deployments if d.name == "ingress"]
        assert ingress.ray_actor_options["num_cpus"] == 0
        return ingress.ray_actor_options["runtime_env"]["env_vars"][PROBE_DEADLINE_ENV]

    monkeypatch.delenv(PROBE_DEADLINE_ENV, raising=False)
    assert float(ingress_deadline()) == 0.5
    monkeypatch.setenv(PROBE_DEADLINE_ENV, "2")
    assert ingress_deadline() == "2"


class NoEngine:
    """The engine deployment's handle where a test stops before the engine: preparing never calls it."""

    def options(self, **_) -> NoEngine:
        return self

    def remote(self, call: GenerateCall):
        raise AssertionError(f"request {call.request_id} reached the engine")


@pytest.fixture(scope="module")
def generation(smollm_dir):
    """The ingress's ``Generation`` with SmolLM2's tokenizer and chat template, up to the engine call."""
    from kvmesh.cluster.ingress.generation import Generation, ModelLimits
    from kvmesh.core.model_files import load_tokenizer, vocab_size

    limits = ModelLimits({"m"}, "m", vocab_size(smollm_dir), max_model_len=2048, max_prompt_bytes=1 << 20, max_n=4)
    return Generation(NoEngine(), load_tokenizer(smollm_dir), model="m", block_size=16, limits=limits)


def _http_chat(generation, messages: list[dict], **fields):
    """A chat completion prepared as the HTTP route prepares it, from the JSON body's fields."""
    import asyncio

    from kvmesh.cluster.ingress.http_api import HttpApi

    api = HttpApi()
    api.generation = generation
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields})
    return asyncio.run(api._prepare_chat(body, ""))[0]


def _grpc_generate(generation, **fields):
    """A ``GenerateRequest`` prepared as the gRPC methods prepare it."""
    import asyncio

    from kvmesh.cluster.ingress.grpc_api import GrpcApi
    from kvmesh.cluster.ingress.proto import kvmesh_pb2

    api = GrpcApi()
    api.generation = generation
    return asyncio.run(api._prepare_grpc(kvmesh_pb2.GenerateRequest(**fields), ""))[0]


def test_a_developer_message_reaches_the_chat_template_as_system_over_http_and_grpc(generation):
    """OpenAI's ``developer`` role is ``system`` to a chat template, whichever API the chat came through:
    SmolLM2's template would otherwise add its default system prompt and render a ``developer`` turn."""
    from kvmesh.cluster.ingress.proto import kvmesh_pb2

    def chat(role: str) -> list[dict]:
        return [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hello"}]

    http = _http_chat(generation, chat("developer"))
    grpc_ = _grpc_generate(generation, messages=[kvmesh_pb2.ChatMessage(**m) for m in chat("developer")])
    as_system = _http_chat(generation, chat("system")).call.prompt_token_ids
    assert http.call.prompt_token_ids == grpc_.call.prompt_token_ids == as_system
    text = generation.tokenizer.decode(http.call.prompt_token_ids)
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>") and "developer" not in text
    # A text part list (HTTP only) renders the same, and a role neither API knows is a 400 over gRPC too.
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]}, chat("user")[1]]
    assert _http_chat(generation, parts).call.prompt_token_ids == as_system
    with pytest.raises(APIError) as err:
        _grpc_generate(generation, messages=[kvmesh_pb2.ChatMessage(role="narrator", content="x")])
    assert (err.value.status, err.value.param) == (400, "messages")


def test_min_p_reaches_sampling_params_over_http_and_grpc_and_out_of_range_is_refused(generation):
    import asyncio

    import grpc

    from kvmesh.cluster.ingress.admission import Admission
    from kvmesh.cluster.ingress.grpc_api import GrpcApi, serve_grpc
    from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc
    from kvmesh.cluster.launch.embedded_redis import free_port

    user = [{"role": "user", "content": "Hello"}]
    assert _http_chat(generation, user, min_p=0.05).params.min_p == 0.05
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "min_p": 1}).check().min_p == 1.0
    assert _http_chat(generation, user).params.min_p == 0.0  # left out: off
    assert _grpc_generate(generation, prompt="Hello", min_p=0.25).params.min_p == 0.25
    assert _grpc_generate(generation, prompt="Hello").params.min_p == 0.0

    class Servicer(GrpcApi):
        def __init__(self) -> None:
            self.generation, self.admission = generation, Admission()

    async def refused(min_p: float) -> grpc.aio.AioRpcError:
        port = free_port()
        server = serve_grpc(Servicer(), "127.0.0.1", port, 1 << 20)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = kvmesh_pb2_grpc.KVMeshStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Complete(kvmesh_pb2.GenerateRequest(prompt="Hello", min_p=min_p))
                return err.value
        finally:
            await server.stop(grace=None)

    for bad in (1.5, -0.25):
        error = asyncio.run(refused(bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("min_p"), error


def test_prompt_size_is_bounded_in_utf8_bytes_not_characters(generation):
    """A token stands for at most so many bytes of text, so the bound before tokenizing counts bytes: 60
    two-byte characters are over a 100-byte bound although 60 characters are not."""
    import asyncio

    from kvmesh.cluster.ingress.generation import Generation

    limits = dataclasses.replace(generation.limits, max_prompt_bytes=100)
    small = Generation(NoEngine(), generation.tokenizer, model="m", block_size=16, limits=limits)

    def ids(prompt=None, messages=None):
        return asyncio.run(small.token_ids(prompt, messages))

    assert ids("é" * 50) == generation.tokenizer.encode("é" * 50)  # 100 bytes: at the bound
    for prompt, messages, param in (
        ("é" * 60, None, "prompt"),
        (None, [{"role": "user", "content": "é" * 30}, {"role": "user", "content": "ü" * 30}], "messages"),
        (None, [{"role": "user", "content": "é" * 45}], "messages"),  # 90 bytes, but over 100 once rendered
    ):
        with pytest.raises(APIError) as err:
            ids(prompt, messages)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", param)
    with pytest.raises(APIError, match="lone surrogate"):
        ids("a\ud800b")


def test_a_request_waits_for_a_live_replica_only_within_the_bound():
    """No engine replica alive for the bound: ``NoLiveReplica`` (the ingress answers 503); a slow first chunk
    while replicas live (a queue), or before the router knows (None), is waited for; chunks pass unchanged."""
    from kvmesh.cluster.ingress.generation import NoLiveReplica, first_then_rest

    async def slow(delay: float, items: list[int]):
        await asyncio.sleep(delay)
        for item in items:
            yield item

    async def collect(delay: float, live, bound: float = 0.5) -> tuple[list[int], float]:
        start = time.monotonic()
        out = [x async for x in first_then_rest(slow(delay, [1, 2, 3]), bound, live)]
        return out, time.monotonic() - start

    assert asyncio.run(collect(1.0, lambda: 2))[0] == [1, 2, 3]  # queued behind busy replicas: it waits
    assert asyncio.run(collect(1.0, lambda: None))[0] == [1, 2, 3]  # not known yet: it waits
    assert asyncio.run(collect(0.0, lambda: 0))[0] == [1, 2, 3]  # an answer in time is taken
    start = time.monotonic()
    with pytest.raises(NoLiveReplica):
        asyncio.run(collect(30.0, lambda: 0))
    assert 0.5 <= time.monotonic() - start < 5.0
    # Replicas that come back reset the clock: dead for two polls, alive, dead for two more (a 1 s span).
    states = iter([0, 0, 2, 0, 0] + [2] * 100)
    assert asyncio.run(collect(2.0, lambda: next(states), bound=0.75))[0] == [1, 2, 3]


def test_nodes_prepared_are_those_an_engine_replica_fits_and_env_reaches_every_replica():
    """Per-node preparation visits the nodes with every resource a replica asks for; the index URL reaches
    replicas through their runtime environment, merged with what the operator set there."""
    from kvmesh.cluster.hosting.nodes import fits
    from kvmesh.cluster.launch.app import with_env

    head = {"Resources": {"CPU": 4.0, "node:__internal_head__": 1.0}}
    gpu_worker = {"Resources": {"CPU": 16.0, "GPU": 1.0, "gpu_pool": 1.0}}
    assert fits(head, {"num_cpus": 0}) and fits(gpu_worker, {"num_cpus": 0})
    assert not fits(head, {"num_gpus": 1}) and fits(gpu_worker, {"num_gpus": 1})
    assert not fits(head, {"num_cpus": 0, "resources": {"gpu_pool": 1}})
    assert fits(gpu_worker, {"num_cpus": 8, "resources": {"gpu_pool": 1}})
    assert not fits(gpu_worker, {"num_cpus": 32})
    options = {"num_cpus": 0, "runtime_env": {"env_vars": {"HF_HOME": "/models"}, "pip": ["x"]}}
    merged = with_env(options, {"KVMESH_REDIS_URL": "redis://:p@10.0.0.1:1/0"})
    assert merged["runtime_env"] == {
        "env_vars": {"HF_HOME": "/models", "KVMESH_REDIS_URL": "redis://:p@10.0.0.1:1/0"},
        "pip": ["x"],
    }
    assert options["runtime_env"]["env_vars"] == {"HF_HOME": "/models"}  # the operator's options untouched


def test_workers_beside_gpu_engines_leave_the_gpus_to_the_engines():
    """``workers:`` beside ``replicas: 2`` GPU engines: the deployment's replicas (a worker's proxy among them)
    claim no GPU; each engine's actor gets ``engine_actor_options`` with the replicas' environment."""
    from ray.serve._private.build_app import build_app as build_serve_app

    from kvmesh.cluster.launch.app import build_app
    from kvmesh.cluster.launch.config import ClusterConfig

    config = ClusterConfig(
        replicas=2, workers=[{"url": "http://gpu-node-1:8000"}], engine_actor_options={"num_gpus": 1}
    )
    built = build_serve_app(build_app(config, env={"KVMESH_REDIS_URL": "redis://r:6379/0"}), name="kvmesh")
    (engine,) = [d for d in built.deployments if d.name == "engine"]
    assert engine._deployment_config.num_replicas == 3
    assert engine.ray_actor_options["num_cpus"] == 0 and not engine.ray_actor_options.get("num_gpus")
    assert engine.ray_actor_options["runtime_env"]["env_vars"]["KVMESH_REDIS_URL"] == "redis://r:6379/0"
    engine_actor_options = engine.init_args[3].actor_options  # the OwnedEngines record, as itself
    assert engine_actor_options["num_gpus"] == 1
    assert engine_actor_options["runtime_env"]["env_vars"]["KVMESH_REDIS_URL"] == "redis://r:6379/0"
