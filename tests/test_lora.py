"""LoRA adapters on the real SmolLM2: greedy tokens equal to PEFT's merged model, alone and in a batch that
mixes the base model and three adapters; each adapter's KV kept apart; bad adapters refused clearly."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import httpx
import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.bench.harness.peer_fleet import Child
from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import InvalidRequest
from kvmesh.core.kv_event_wire import EventBatch, decode_batch, encode_batch
from kvmesh.core.messages import GenerateCall
from kvmesh.kernels import lora as kernels_lora
from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.kv_event_publisher import WireEncoder
from kvmesh.replica.lora_weights import LoRAError
from kvmesh.router.worker_blocks import WorkerBlocks
from tests.lora_helpers import ALL_MODULES, make_adapter, merged_greedy, merged_model, token_logprobs

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time in a land far away, there lived"]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ADAPTERS = {  # name: (rank, target modules, seed)
    "r8-all": (8, ALL_MODULES, 1),
    "r16-attn": (16, ["q_proj", "v_proj", "o_proj"], 2),
    "r16-mlp": (16, ["gate_proj", "up_proj", "down_proj"], 3),
}


@pytest.fixture(scope="module")
def adapters(smollm_dir, tmp_path_factory):
    """Each adapter's directory and PEFT's merged-model greedy tokens per prompt; the base model's too."""
    root = tmp_path_factory.mktemp("loras")
    ids = [AutoTokenizer.from_pretrained(smollm_dir).encode(p) for p in PROMPTS]
    expected, dirs = {None: merged_greedy(smollm_dir, None, ids, NEW_TOKENS)}, {}
    for name, (rank, modules, seed) in ADAPTERS.items():
        dirs[name] = root / name
        make_adapter(smollm_dir, dirs[name], rank, modules, seed)
        expected[name] = merged_greedy(smollm_dir, dirs[name], ids, NEW_TOKENS)
    return ids, dirs, expected


@pytest.fixture(scope="module")
def llm(smollm_dir, adapters):
    _, dirs, _ = adapters
    modules = {name: str(path) for name, path in dirs.items()}
    with LLM(str(smollm_dir), dtype="float32", enable_lora=True, lora_modules=modules) as llm:
        yield llm


def test_each_adapter_alone_gives_peft_merged_tokens_and_logprobs(llm, adapters, smollm_dir):
    ids, dirs, expected = adapters
    assert all(expected[name] != expected[None] for name in ADAPTERS)  # the adapters change the output
    with_logprobs = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    for name in [*ADAPTERS, None]:
        outs = llm.generate(ids, with_logprobs, lora=name)
        assert [o.token_ids for o in outs] == expected[name], name
        merged = merged_model(smollm_dir, dirs.get(name))
        for prompt, out in zip(ids, outs, strict=True):
            want = token_logprobs(merged, prompt, out.token_ids)
            got = [lp.logprob for lp in out.logprobs]
            assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < 2e-3, name


def _each_gets_its_own(llm, ids, expected) -> None:
    """Every prompt under the base model and each adapter, in one batch: each gets PEFT's tokens for its own."""
    names = [None, *ADAPTERS]
    prompts = [i for i in ids for _ in names]
    loras = [n for _ in ids for n in names]
    outs = llm.generate(prompts, GREEDY, lora=loras)
    for out, prompt, name in zip(outs, prompts, loras, strict=True):
        assert out.token_ids == expected[name][ids.index(prompt)], name


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_a_batch_mixing_base_and_three_adapters_gives_each_its_own(llm, adapters, monkeypatch, compiled):
    """Both versions of the segmented LoRA op (the CPU kernel and the torch definition) give every request
    its own adapter's tokens."""
    if not compiled:
        monkeypatch.setattr(kernels_lora, "cpu_op", lambda name: None)
    ids, _, expected = adapters
    _each_gets_its_own(llm, ids, expected)


def test_max_loras_caps_the_adapters_one_step_runs(llm, adapters, monkeypatch):
    """With ``max_loras`` 2, no step runs more than two adapters (the base model is not one); requests on the
    third wait their turn and every request still gets its own adapter's tokens."""
    ids, _, expected = adapters
    scheduler = llm.engine.scheduler
    monkeypatch.setattr(scheduler, "max_loras", 2)
    per_step, schedule = [], scheduler.schedule

    def recording():
        scheduled = schedule()
        per_step.append({s.request.lora.name for s in scheduled if s.request.lora is not None})
        return scheduled

    monkeypatch.setattr(scheduler, "schedule", recording)
    _each_gets_its_own(llm, ids, expected)
    assert max(len(step) for step in per_step) == 2
    assert set().union(*per_step) == set(ADAPTERS)
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=0)


def test_an_adapters_kv_is_its_own(llm, adapters):
    """A prompt cached under the base model is not reused under an adapter, nor under another adapter;
    repeated under the same adapter it is."""
    ids, _, _ = adapters
    prompt = ids[2] * 3  # several full blocks
    llm.engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0)

    def cached(name):
        return llm.generate(prompt, params, lora=name)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached("r8-all") == 0
    assert cached("r16-attn") == 0
    assert cached("r8-all") > 0 and cached(None) > 0


def test_unknown_adapters_and_bad_files_are_refused(llm, adapters, smollm_dir, tmp_path, tiny_llama_dir):
    ids, dirs, _ = adapters
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'nope'"):
        llm.generate(ids[0], GREEDY, lora="nope")
    with pytest.raises(LoRAError, match=r"adapter_config\.json"):
        llm.engine.load_lora("empty", str(tmp_path))
    big = tmp_path / "r32"
    make_adapter(smollm_dir, big, 32, ["q_proj"], 4)
    with pytest.raises(LoRAError, match="rank 32, over this engine's max_lora_rank 16"):
        llm.engine.load_lora("big", str(big))
    other = tmp_path / "other-model"
    config = peft.LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft.get_peft_model(base, config).save_pretrained(other)
    with pytest.raises(LoRAError, match="another model"):
        llm.engine.load_lora("other", str(other))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((dirs["r8-all"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(LoRAError, match="cannot be read"):
        llm.engine.load_lora("broken", str(broken))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((dirs["r8-all"] / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="use_dora"):
        llm.engine.load_lora("dora", str(dora))
    assert sorted(llm.engine.loras.names()) == sorted(ADAPTERS)  # nothing half-loaded
    assert llm.generate(ids[0], GREEDY, lora="r8-all")[0].token_ids == adapters[2]["r8-all"][0]


def test_unloaded_adapter_is_refused_and_reloads(llm, adapters):
    ids, dirs, expected = adapters
    assert llm.engine.unload_lora("r16-mlp")
    with pytest.raises(InvalidRequest):
        llm.generate(ids[0], GREEDY, lora="r16-mlp")
    llm.engine.load_lora("r16-mlp", str(dirs["r16-mlp"]))
    assert llm.generate(ids[0], GREEDY, lora="r16-mlp")[0].token_ids == expected["r16-mlp"][0]


@pytest.mark.timeout(600)
def test_kvmesh_engine_serves_loads_and_unloads_adapters_over_http(smollm_dir, adapters, tmp_path):
    """``kvmesh engine --lora-modules``: the adapter is a model in ``/v1/models`` and answers as PEFT's merged
    model; ``/v1/load_lora_adapter`` loads only from ``--lora-root``, refuses bad files and a name already
    served with a 400 (the engine serves on); unloaded while a request on it streams, that request finishes
    on it and the name then gets OpenAI's 404; every route wants the API key."""
    ids, dirs, expected = adapters
    decode = AutoTokenizer.from_pretrained(smollm_dir).decode
    port, key = free_port(), "sk-lora-test"
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", str(smollm_dir), "--port", str(port)]
    cmd += ["--lora-modules", f"r8-all={dirs['r8-all']}", "--lora-root", str(dirs["r16-attn"].parent)]
    cmd += ["--api-key", key, "--threads", "1"]
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_REDIS_URL"}
    server = Child("lora-engine", cmd, f"http://127.0.0.1:{port}", "/health", env)
    auth = {"Authorization": f"Bearer {key}"}

    def complete(model, prompt=ids[0]):
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=120)

    def load(name, path):
        body = {"lora_name": name, "lora_path": str(path)}
        return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=auth, timeout=60)

    try:
        server.wait_ready()
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{server.url}/v1/models", headers=auth, timeout=10).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [(str(smollm_dir), None), ("r8-all", str(smollm_dir))]
        answer = complete("r8-all")
        assert _text(answer) == decode(expected["r8-all"][0]) and answer.json()["model"] == "r8-all"
        assert _text(complete(str(smollm_dir))) == decode(expected[None][0])
        missing = complete("r16-attn")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        outside = load("x", tmp_path)
        assert outside.status_code == 400 and "--lora-root" in outside.json()["error"]["message"]
        (dirs["r16-attn"].parent / "junk").mkdir(exist_ok=True)
        bad = load("junk", dirs["r16-attn"].parent / "junk")
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        assert load("r16-attn", dirs["r16-attn"]).status_code == 200
        assert load("r16-attn", dirs["r16-mlp"]).status_code == 400  # the name is taken: unload it first
        assert _text(complete("r16-attn")) == decode(expected["r16-attn"][0])
        body = {"lora_name": "r16-attn"}
        stream = {"model": "r16-attn", "prompt": ids[1], "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=stream | {"stream": True}, headers=auth) as s:
            events = s.iter_lines()
            streamed = [next(line for line in events if line.startswith("data: "))]  # in flight now
            unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, headers=auth)
            streamed += [line for line in events if line.startswith("data: {")]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in streamed if json.loads(e[6:])["choices"])
        assert unloaded.status_code == 200  # and the request in flight finished on the adapter it started with:
        assert len(streamed) > 2 and text.startswith(decode(expected["r16-attn"][1]))
        assert complete("r16-attn").status_code == 404
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, headers=auth).status_code == 404
        assert _text(complete("r8-all")) == decode(expected["r8-all"][0])  # still serving
    finally:
        server.stop()


def _text(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_kv_events_name_the_adapter_so_a_router_rebuilds_its_hashes(llm, adapters):
    """An adapter request's KV events carry ``lora_name`` (and vLLM's extra keys); a router following them
    over the wire (``WorkerBlocks``) derives exactly the block hashes the engine cached, base and adapter alike."""
    ids, _, _ = adapters
    engine = llm.engine
    engine.reset_prefix_cache()
    events: list = []
    engine.kv_event_sinks.append(events.extend)
    try:
        llm.generate([ids[2] * 3, ids[2] * 3], SamplingParams(max_tokens=1, temperature=0), lora=["r8-all", None])
    finally:
        engine.kv_event_sinks.remove(events.extend)
    assert {e.lora_name for e in events if e.kind == "stored"} == {"r8-all", None}
    wire = decode_batch(encode_batch(EventBatch(ts=0.0, events=WireEncoder(engine.block_size).encode(events))))
    assert any(e.lora_name == "r8-all" for e in wire.events)
    blocks = WorkerBlocks(engine.hash_seed, engine.block_size)
    blocks.apply(wire)
    assert set(blocks.snapshot()) == set(engine.pool.cached_hashes()) and blocks.unlinked == 0


def test_a_replica_reads_the_adapter_a_call_names_from_where_it_lies(smollm_dir, adapters, tmp_path):
    """In a cluster the ingress records where each adapter lies and every call carries it: a replica that has
    not read the adapter reads it on its first call and answers as PEFT's merged model, then reports holding
    it (what routers price); one it cannot read is a 400 on ``model``, the replica serving on."""
    ids, dirs, expected = adapters
    replica = EngineReplica(EngineConfig(model=str(smollm_dir), dtype="float32", enable_lora=True, torch_threads=1))

    def call(name, path, prompt):
        return GenerateCall(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            block_hashes=[],
            block_size=16,
            params=GREEDY,
            lora_name=name,
            lora_path=str(path) if path else None,
        )

    async def tokens(name, path, prompt):
        return [t async for chunk in replica.generate(call(name, path, prompt)) for t in chunk.token_ids]

    async def run():
        adapted = await tokens("r16-mlp", dirs["r16-mlp"], ids[1])
        with pytest.raises(InvalidRequest, match=r"'junk' cannot be served.*adapter_config") as bad:
            await tokens("junk", tmp_path, ids[0])
        return adapted, bad.value.param, await tokens(None, None, ids[0])

    try:
        tokens, param, base = asyncio.run(run())
        report = replica.stats()
    finally:
        replica.close()
    assert tokens == expected["r16-mlp"][1] and base == expected[None][0] and param == "model"
    assert report.loras == ["r16-mlp"] and report.lora_slots == 8 and report.lora_load_s > 0
