"""End to end: ``kvmesh serve`` in its own process (own Ray, embedded Redis, 2 replicas of the tiny model),
spoken to with the official ``openai`` client, a gRPC client and ``kvmesh status``, then stopped with
SIGTERM, after which none of its processes may remain. The shutdown test runs last in this module."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc
from tests.lora_helpers import ALL_MODULES, make_adapter, merged_greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KEY, OTHER_KEY = "e2e-secret-key", "e2e-other-tenant-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
ADAPTERS = ("tone", "style")
"""Served from the start; each replica holds one adapter's weights at a time (``--max-cpu-loras 1``)."""
LONG_PROMPT = " ".join(f"Fact {i}: the router keeps prefix {i} warm on one replica." for i in range(40))


@pytest.fixture(scope="module")
def lora_root(tiny_llama_dir, tmp_path_factory) -> Path:
    """PEFT adapters of the tiny model: ``tone`` and ``style`` served from the start, ``extra`` loaded later."""
    root = tmp_path_factory.mktemp("tiny-loras")
    for seed, name in enumerate((*ADAPTERS, "extra")):
        make_adapter(tiny_llama_dir, root / name, 8, ALL_MODULES, seed, scale=0.5)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, lora_root):
    args = [
        "--model",
        str(tiny_llama_dir),
        "--replicas",
        "2",
        "--threads",
        "1",
        "--max-num-seqs",
        "8",
        "--api-key",
        KEY,
        "--api-key",
        OTHER_KEY,
        "--max-request-bytes",
        str(1 << 20),
        "--lora-modules",
        *(f"{name}={lora_root / name}" for name in ADAPTERS),
        "--max-cpu-loras",
        "1",
        "--lora-root",
        str(lora_root),
    ]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as srv:
        srv.model = str(tiny_llama_dir)
        srv.wait_ready(timeout_s=180)
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, server, content: str, **kw):
    return client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": content}], **kw)


def test_chat_and_completions_whole_and_streamed_agree(client, server):
    whole = chat(client, server, "Tell me about caches", max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    stream = chat(
        client,
        server,
        "Tell me about caches",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]

    comp = client.completions.create(model=server.model, prompt="The cache", max_tokens=8, temperature=0)
    assert comp.object == "text_completion" and comp.usage.completion_tokens == 8
    streamed = client.completions.create(
        model=server.model, prompt="The cache", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text


def test_repeated_long_prompt_reports_cached_tokens(client, server):
    first = chat(client, server, LONG_PROMPT, max_tokens=2, temperature=0)
    second = chat(client, server, LONG_PROMPT, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 400
    assert first.usage.prompt_tokens_details.cached_tokens < n // 2
    # Every full block of the prompt is cached except possibly the last (one token must be computed).
    assert second.usage.prompt_tokens_details.cached_tokens >= (n // 16 - 1) * 16


def test_cache_salt_keeps_tenants_apart(client, server):
    prompt = "Private notes of one tenant. " + LONG_PROMPT[:1200]

    def cached(salt: str) -> int:
        r = chat(client, server, prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 200  # the same tenant reuses its prefix
    assert cached("tenant-b") == 0  # another tenant never does, not even the chat template's first block


def test_stop_strings_end_the_output_before_them(client, server):
    free = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    stopped = client.completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_logit_bias_forces_and_bans_through_the_official_client(client, server):
    plain = client.completions.create(model=server.model, prompt=LONG_PROMPT[:200], max_tokens=4, temperature=0)
    first = httpx.post(
        server.url + "/tokenize", json={"prompt": plain.choices[0].text, "add_special_tokens": False}, headers=AUTH
    ).json()["tokens"][0]
    forced = 1234 if first != 1234 else 1235
    out = client.completions.create(
        model=server.model, prompt=LONG_PROMPT[:200], max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    text = httpx.post(server.url + "/detokenize", json={"tokens": [forced] * 4}, headers=AUTH).json()["prompt"]
    assert out.choices[0].text == text
    banned = client.completions.create(
        model=server.model, prompt=LONG_PROMPT[:200], max_tokens=4, temperature=0, logit_bias={str(first): -100}
    )
    assert banned.choices[0].text != plain.choices[0].text


def test_penalties_change_the_output_alike_over_http_and_grpc(client, server):
    """Negative penalties reward what was generated: the tiny model's greedy text, which never repeats a
    token, turns repetitive; gRPC carries the same penalties and gets the same text."""
    ask = {"model": server.model, "prompt": "la la la la", "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**ask)
    penalised = client.completions.create(**ask, frequency_penalty=-2.0, presence_penalty=-2.0, logprobs=0)
    tokens = penalised.choices[0].logprobs.tokens
    assert penalised.choices[0].text != plain.choices[0].text and len(set(tokens)) < len(tokens)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        request = kvmesh_pb2.GenerateRequest(
            prompt="la la la la", max_tokens=16, temperature=0, frequency_penalty=-2.0, presence_penalty=-2.0
        )
        over_grpc = kvmesh_pb2_grpc.KVMeshStub(channel).Complete(request, timeout=60, metadata=GRPC_AUTH).text
    assert over_grpc == penalised.choices[0].text


def test_logprobs_whole_and_streamed_in_openais_shapes(client, server):
    ask = {"model": server.model, "max_tokens": 6, "temperature": 0}
    messages = [{"role": "user", "content": "Tell me about caches"}]
    whole = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=5, **ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for item in content:
        assert len(item.top_logprobs) == 5 and item.logprob == max(t.logprob for t in item.top_logprobs)
        assert sum(math.exp(t.logprob) for t in item.top_logprobs) <= 1 + 1e-5
        assert item.bytes == list(item.token.encode("utf-8"))
    streamed = [
        item
        for chunk in client.chat.completions.create(
            messages=messages, logprobs=True, top_logprobs=5, stream=True, **ask
        )
        for choice in chunk.choices
        if choice.logprobs is not None
        for item in choice.logprobs.content
    ]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == [(i.token, round(i.logprob, 4)) for i in content]
    assert chat(client, server, "Tell me about caches", max_tokens=2).choices[0].logprobs is None
    completion = client.completions.create(prompt=LONG_PROMPT[:120], logprobs=3, **ask).choices[0]
    lp = completion.logprobs
    assert "".join(lp.tokens) == completion.text and len(lp.token_logprobs) == 6
    for top, value in zip(lp.top_logprobs, lp.token_logprobs, strict=True):  # ids decoding alike share a key
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_returns_the_prompt_and_its_logprobs_whole_and_streamed(client, server):
    """lm-eval's loglikelihood request: echo, logprobs 1, one token. The prompt's tokens come first, the
    first with no log-probability, every other one scored and no likelier than its top alternative."""
    prompt = "The cache keeps the prefix warm"
    ask = {"model": server.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    whole = client.completions.create(**ask).choices[0]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()["tokens"]
    lp = whole.logprobs
    assert whole.text.startswith(prompt) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert chosen <= 0 and len(top) == 1 and max(top.values()) >= chosen - 1e-4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens[: len(ids)]) == prompt
    streamed = list(client.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    plain = client.completions.create(**{**ask, "logprobs": None}).choices[0]
    assert plain.text == whole.text and plain.logprobs is None


def test_response_format_json_schema_constrains_the_output(client, server):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):  # a random model: only the grammar makes these JSON
        reply = chat(client, server, "answer", max_tokens=40, temperature=1.0, seed=seed, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, server, "x", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": 5}})
    assert bad.value.body["param"] == "response_format"


def test_tokenize_and_detokenize_in_vllms_shapes(client, server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        r = http.post("/tokenize", json={"model": server.model, "prompt": LONG_PROMPT, "return_token_strs": True})
        body = r.json()
        assert r.status_code == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 100
        assert body["max_model_len"] > body["count"]
        usage = client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=1).usage
        assert usage.prompt_tokens == body["count"]  # what a generation of the same prompt counts
        text = http.post("/detokenize", json={"model": server.model, "tokens": body["tokens"]}).json()["prompt"]
        assert LONG_PROMPT in text
        messages = [{"role": "user", "content": "hello there"}]
        chat_ids = http.post("/tokenize", json={"messages": messages}).json()
        assert chat(client, server, "hello there", max_tokens=1).usage.prompt_tokens == chat_ids["count"]
        assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_seed_makes_sampling_reproducible(client, server):
    def sample(seed: int) -> str:
        return chat(client, server, "Pick words", max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_n_choices_whole_and_streamed(client, server):
    """n=3 is one request: greedy choices equal the single answer; seeded ones differ and reproduce."""
    single = chat(client, server, "Tell me about forks", max_tokens=10, temperature=0)
    whole = chat(client, server, "Tell me about forks", max_tokens=10, temperature=0, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [single.choices[0].message.content] * 3
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens and whole.usage.completion_tokens == 30
    chunks = list(
        chat(
            client,
            server,
            "Tell me about forks",
            max_tokens=10,
            temperature=0,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    assert [c.index for c in choices if c.delta.role == "assistant"] == [0, 1, 2]
    texts = ["".join(c.delta.content or "" for c in choices if c.index == i) for i in range(3)]
    assert texts == [c.message.content for c in whole.choices]
    assert sorted(c.index for c in choices if c.finish_reason) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30

    def sample(n: int = 3, **kw):
        return client.completions.create(
            model=server.model, prompt="Pick words", max_tokens=12, temperature=1.0, seed=5, n=n, **kw
        )

    comp = sample()
    assert [c.index for c in comp.choices] == [0, 1, 2] and comp.usage.completion_tokens == 36
    assert len({c.text for c in comp.choices}) > 1
    assert [c.text for c in sample().choices] == [c.text for c in comp.choices]
    streamed = [c.choices[0] for c in sample(stream=True)]
    assert ["".join(c.text for c in streamed if c.index == i) for i in range(3)] == [c.text for c in comp.choices]
    with pytest.raises(openai.BadRequestError) as bad:
        sample(n=17)
    assert bad.value.body["param"] == "n"


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, server, "x", temperature=-1)
    assert bad.value.body["type"] == "invalid_request_error" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        chat(client, server, "x", max_tokens=5000)  # beyond the tiny model's 1024-token context
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=AUTH, timeout=10)
    assert raw.status_code == 400 and "error" in raw.json()
    assert [m.id for m in client.models.list().data] == [server.model, *ADAPTERS]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MALFORMED = [  # (path, body: bytes are sent as is, dicts as JSON with the served model added, expected status)
    (CHAT, b"{not json", 400),
    (CHAT, b"", 400),
    (CHAT, b"[]", 400),
    (CHAT, b'"a string"', 400),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),  # invalid UTF-8
    (CHAT, {}, 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": [{"content": "no role"}]}, 400),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"messages": [{"role": "user"}]}, 400),
    (CHAT, _chat(max_tokens=-1), 400),
    (CHAT, _chat(max_tokens=0), 400),
    (CHAT, _chat(max_tokens=10**9), 400),
    (CHAT, _chat(max_tokens="ten"), 400),
    (CHAT, _chat(max_completion_tokens=-5), 400),
    (CHAT, _chat(temperature=-0.5), 400),
    (CHAT, _chat(temperature="hot"), 400),
    (CHAT, _chat(top_p=0), 400),
    (CHAT, _chat(top_p=1.5), 400),
    (CHAT, _chat(top_k=-5), 400),
    (CHAT, _chat(n=0), 400),
    (CHAT, _chat(n=17), 400),
    (COMP, {"prompt": "x", "n": 9}, 400),  # more choices than a replica runs at once (--max-num-seqs 8)
    (CHAT, _chat(logprobs=True, top_logprobs=21), 400),
    (COMP, {"prompt": "x", "logprobs": 6}, 400),
    (CHAT, _chat(tools=[{"type": "function", "function": {"name": ""}}]), 400),
    (CHAT, _chat(response_format={"type": "regex"}), 400),
    (CHAT, _chat(presence_penalty=2.5), 400),
    (CHAT, _chat(logit_bias={"5": 500}), 400),
    (CHAT, _chat(logit_bias={str(10**6): 5}), 400),  # not a token of the model
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),  # a lone surrogate
    ("/tokenize", {"messages": []}, 400),
    (CHAT, _chat(stop=5), 400),
    (CHAT, _chat(stop=[""]), 400),
    (CHAT, _chat(seed="abc"), 400),
    (CHAT, _chat(cache_salt=123), 400),
    (CHAT, _chat(session_id={"a": 1}), 400),
    (CHAT, _chat(model="no-such-model"), 404),
    (CHAT, _chat(model=None), 400),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 1500}]}, 400),  # longer than the context
    (COMP, {}, 400),
    (COMP, {"prompt": ""}, 400),
    (COMP, {"prompt": [10**9]}, 400),
    (COMP, {"prompt": {"a": 1}}, 400),
    (COMP, {"prompt": [[1, 2], [3, 4]]}, 400),
    (COMP, {"prompt": "x", "max_tokens": -3}, 400),
    (COMP, b"x" * ((1 << 20) + 1), 413),  # over --max-request-bytes
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(client, server):
    assert len(MALFORMED) >= 30
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, body, expected in MALFORMED:
            if isinstance(body, dict) and "model" not in body:
                body = {"model": server.model, **body}  # so each case fails for its own reason, not the model
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = http.post(path, **kw)
            assert r.status_code == expected, (path, body if not isinstance(body, bytes) else body[:60], r.text[:300])
            error = r.json()["error"]
            assert error["message"] and error["type"], r.text
        assert http.get(CHAT).status_code == 405 and http.post("/v1/nope", json={}).status_code == 404
    assert chat(client, server, "still there?", max_tokens=2).choices[0].finish_reason == "length"


def test_fuzzing_the_api_from_its_openapi_schema_finds_no_server_error(server, tmp_path):
    """Schemathesis generates valid and invalid requests for every operation of the OpenAPI schema (bounded:
    examples per operation and a time budget), with extreme values mixed into the bodies
    (``tests/schemathesis_hooks.py``: 2^63, NaN, 1e308, empty and huge strings and lists); no answer may be
    a 5xx and the server keeps serving. The schema is the app's own (the server does not publish it by
    default). Judged from its JUnit report: a <failure> is a check that failed (a 5xx); an <error> is the
    generator's own trouble."""
    import xml.etree.ElementTree as ET

    from kvmesh.cluster.ingress.http_api import app

    schema = tmp_path / "openapi.json"
    schema.write_text(json.dumps(app.openapi()))
    report = tmp_path / "junit.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            str(schema),
            "--url",
            server.url,
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "40",
            "--max-time",
            "60",
            "--workers",
            "2",
            "--phases",
            "examples,fuzzing",
            "--generation-deterministic",
            "--request-timeout",
            "60",
            "-H",
            f"Authorization: Bearer {KEY}",
            "--report",
            "junit",
            "--report-junit-path",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert report.exists(), run.stdout[-3000:] + run.stderr[-2000:]
    cases = {c.get("name"): c for c in ET.parse(report).getroot().iter("testcase")}
    failed = {name: c.find("failure").text[:1500] for name, c in cases.items() if c.find("failure") is not None}
    assert not failed, failed
    tested = {name for name, c in cases.items() if c.find("error") is None}
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= tested, run.stdout[-3000:]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert chat(openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0), server, "ok?", max_tokens=2)


BOUNDS = [  # (path, fields, the parameter the 400 must name); each is one field out of bounds
    (CHAT, {"top_k": 2**63}, "top_k"),
    (CHAT, {"top_k": 49153}, "top_k"),
    (CHAT, {"temperature": math.nan}, "temperature"),
    (CHAT, {"temperature": math.inf}, "temperature"),
    (CHAT, {"temperature": 1e308}, "temperature"),
    (CHAT, {"top_p": math.nan}, "top_p"),
    (CHAT, {"top_p": 2}, "top_p"),
    (CHAT, {"seed": 2**64}, "seed"),
    (CHAT, {"max_tokens": 2**63}, "max_tokens"),
    (CHAT, {"n": 2**63}, "n"),
    (CHAT, {"stop": ["s"] * 17}, "stop"),
    (CHAT, {"stop": ["s" * 257]}, "stop"),
    (CHAT, {"user": "u" * 257}, "user"),
    (CHAT, {"session_id": "s" * 257}, "session_id"),
    (CHAT, {"cache_salt": "c" * 257}, "cache_salt"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}] * 4097}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200_000}]}, "messages"),  # cannot fit, not tokenized
    (COMP, {"prompt": "x", "top_k": 2**63}, "top_k"),
    (COMP, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    (COMP, {"prompt": list(range(2000))}, "prompt"),
]


def test_every_bound_is_a_400_naming_the_parameter(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path, fields, param in BOUNDS:
            body = {
                "model": server.model,
                **({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {}),
            }
            r = http.post(
                path, content=json.dumps({**body, **fields}).encode(), headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (fields if len(str(fields)) < 200 else param, r.text[:300])
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (param, error)


def test_grpc_bounds_are_invalid_argument_naming_the_parameter(server):
    cases = [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_k": 2**31 - 1}, "top_k"),
        ({"n": 2**32 - 1}, "n"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"cache_salt": "c" * 257}, "cache_salt"),
        ({"session_id": "s" * 257}, "session_id"),
        ({"prompt": "word " * 200_000}, "prompt"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        for fields, param in cases:
            request = kvmesh_pb2.GenerateRequest(**{"prompt": "x", **fields})
            for call in (stub.Complete, lambda r, **kw: list(stub.Generate(r, **kw))):
                with pytest.raises(grpc.RpcError) as bad:
                    call(request, timeout=60, metadata=GRPC_AUTH)
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (param, bad.value.details())
                assert param in bad.value.details(), (param, bad.value.details())
        huge = kvmesh_pb2.GenerateRequest(prompt="x" * ((1 << 20) + 1))  # over --max-request-bytes
        with pytest.raises(grpc.RpcError) as too_big:
            stub.Complete(huge, timeout=60, metadata=GRPC_AUTH)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_requests_that_would_fail_a_step_leave_a_running_stream_untouched(client, server):
    """Bad requests sent while a stream runs: each is refused with a 400, and the stream completes with
    exactly the tokens it produces alone."""
    kw = {"max_tokens": 60, "temperature": 0, "extra_body": {"ignore_eos": True, "session_id": "steady"}}
    alone = chat(client, server, "A steady stream of tokens", **kw).choices[0].message.content
    stream = chat(client, server, "A steady stream of tokens", stream=True, **kw)
    first = next(stream)
    bad = [{"top_k": 2**63}, {"temperature": math.nan}, {"seed": 2**64}, {"top_p": math.inf}, {"stop": ["s"] * 100}]
    with httpx.Client(base_url=server.url, headers={**AUTH, "content-type": "application/json"}, timeout=30) as http:
        for fields in bad:
            body = {"model": server.model, "messages": [{"role": "user", "content": "break"}], "session_id": "steady"}
            r = http.post(CHAT, content=json.dumps({**body, **fields}).encode())
            assert r.status_code == 400, (fields, r.text)
    text = (first.choices[0].delta.content or "") + "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == alone


def test_tenants_keyed_by_api_key_neither_share_nor_see_each_others_cache(server):
    """With API keys, the prefix cache is per key: the same long prompt under a second key is computed
    afresh, so ``cached_tokens`` cannot tell one tenant what another has sent."""
    prompt = "The quarterly numbers of one customer. " + LONG_PROMPT[:1500]

    def cached(key: str) -> int:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
        return chat(c, server, prompt, max_tokens=1, temperature=0).usage.prompt_tokens_details.cached_tokens

    cached(KEY)
    assert cached(KEY) > 200  # the same key reuses its prefix
    assert cached(OTHER_KEY) == 0  # the other key gets no hit, not even on the chat template's first block
    assert cached(OTHER_KEY) > 200


def test_nothing_listens_beyond_loopback_and_redis_wants_its_password(server):
    """Every listening socket of every process ``kvmesh serve`` started (Ray's own included) is on
    loopback; gRPC answers on the HTTP host; the embedded Redis refuses clients without the password,
    which appears in no command line and not in the server's output."""
    import psutil
    import redis

    server.remember_processes()
    listening, redis_port, url = {}, None, None
    for pid in {server.proc.pid, *server.descendants}:
        try:
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[(conn.laddr.ip, conn.laddr.port)] = proc.name()
            if proc.name().startswith("redis-server"):
                redis_port = next(c.laddr.port for c in proc.net_connections() if c.status == psutil.CONN_LISTEN)
            url = url or proc.environ().get("KVMESH_REDIS_URL")
        except psutil.NoSuchProcess:
            continue
    loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    ports = {port for ip, port in listening if ip in loopback}
    assert {server.grpc, server.http} <= ports, listening
    wide = {addr: name for addr, name in listening.items() if addr[0] not in loopback}
    # Ray Serve 2.60 binds each replica's inter-deployment gRPC server on [::] (hard-coded); Ray's token
    # authentication, on by default for a local cluster, guards it. Nothing else may listen wider.
    assert all(name.startswith("ray::ServeReplica") for name in wide.values()), f"beyond loopback: {wide}"
    for _, port in wide:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            probe = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
            with pytest.raises(grpc.RpcError) as refused:
                probe(b"", timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (port, refused.value)

    assert redis_port and url
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=5).ping()
    assert redis.Redis.from_url(url, socket_timeout=5).ping()
    password = url.split("://:", 1)[1].split("@", 1)[0]
    assert len(password) >= 16 and password not in server.log.read_text()
    for pid in server.descendants:
        try:
            assert password not in " ".join(psutil.Process(pid).cmdline())
        except psutil.NoSuchProcess:
            continue


def test_docs_are_off_and_every_4xx_is_an_openai_error(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = http.get(path)
            assert r.status_code == 404 and r.json()["error"]["message"], path
        for r in (http.get("/v1/nope"), http.get(CHAT), http.post("/v1/nope", json={})):
            assert r.status_code in (404, 405) and set(r.json()) == {"error"}, r.text


def test_api_keys_are_required_on_the_api_but_not_on_probes(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(server.url + "/status", headers=headers, timeout=30).status_code == 401
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    no_key = subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster.launch.cli", "status", "--url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_key.returncode == 1 and "API key" in no_key.stderr


def test_client_hanging_up_aborts_the_generation(server):
    body = {"model": server.model, "prompt": "Go on and on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i == 4:
                break  # leave mid-stream: closes the connection
    t_left = time.monotonic()
    deadline = t_left + 10
    while time.monotonic() < deadline:
        replicas = httpx.get(server.url + "/status", headers=AUTH, timeout=10).json()["replicas"]
        if replicas and all(r["num_running"] == 0 and r["kv_usage"] == 0 for r in replicas.values()):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the abandoned request still runs: {replicas}")
    freed_s = time.monotonic() - t_left
    # Within 1 s, seen through the replicas' status reports, which are refreshed every 0.6 s (TTL / 5).
    assert freed_s <= 1.6, f"blocks freed only {freed_s:.2f} s after the client left"
    print(f"blocks freed and seen freed {freed_s:.2f} s after the client left")
    aborted = [
        line
        for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
        if line.startswith("kvmesh_requests_total{") and 'api="completions"' in line and 'outcome="aborted"' in line
    ]
    assert aborted and float(aborted[0].split()[-1]) == 1.0  # cancelled, not run to its 900 tokens


def test_adapters_answer_as_peft_and_go_where_they_are_held(server, lora_root):
    """Adapters named as the model answer as PEFT's merged model, over HTTP and gRPC. Each replica holds one
    adapter at a time: once a request on ``tone`` went to one replica, later ``tone`` requests (new prompts, no
    cached prefix) go to it and ``style`` requests to the other, which still holds ``style``. An adapter loaded
    at run time (only from under ``--lora-root``) is read by the replica the router sends it to; unloaded, 404."""
    prompts = [[100 + 37 * i + j for j in range(24)] for i in range(10)]
    names = (*ADAPTERS, "extra", None)
    expected = {name: merged_greedy(server.model, name and lora_root / name, prompts, 6) for name in names}
    assert expected["tone"] != expected[None] and expected["style"] != expected[None]  # the adapters matter

    def complete(model, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"], reply.headers["x-kvmesh-replica"]

    def text(name, i):
        return httpx.post(
            server.url + "/detokenize", json={"tokens": expected[name][i]}, headers=AUTH, timeout=30
        ).json()["prompt"]

    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert {(m["id"], m.get("parent")) for m in models[1:]} == {(name, models[0]["id"]) for name in ADAPTERS}
    first, tone_home = complete("tone", prompts[0])
    assert first == text("tone", 0)
    served = {"tone": [complete("tone", prompts[i]) for i in range(1, 5)]}
    time.sleep(2.0)  # the replicas' load reports (each second) now say which holds which adapter
    served["style"] = [complete("style", prompts[i]) for i in range(1, 5)]
    for name, replies in served.items():
        assert [t for t, _ in replies] == [text(name, i) for i in range(1, 5)]
    assert {r for _, r in served["tone"]} == {tone_home}
    assert len({r for _, r in served["style"]}) == 1 and served["style"][0][1] != tone_home

    def load(name, path):
        body = {"lora_name": name, "lora_path": str(path)}
        return httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)

    outside = load("x", lora_root.parent)
    assert outside.status_code == 400 and "--lora-root" in outside.json()["error"]["message"]
    assert load("bad", lora_root).status_code == 400  # no adapter_config.json there
    assert load("extra", lora_root / "extra").status_code == 200
    assert load("extra", lora_root / "extra").status_code == 400  # already served
    assert complete("extra", prompts[5])[0] == text("extra", 5)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        request = kvmesh_pb2.GenerateRequest(model="style", prompt="Tell me", max_tokens=6, temperature=0)
        over_grpc = stub.Complete(request, timeout=60, metadata=GRPC_AUTH).text
    body = {"model": "style", "prompt": "Tell me", "max_tokens": 6, "temperature": 0}
    over_http = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert over_grpc == over_http.json()["choices"][0]["text"]
    unload = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "extra"}, headers=AUTH, timeout=30)
    assert unload.status_code == 200
    gone = httpx.post(server.url + "/v1/completions", json={"model": "extra", "prompt": "x"}, headers=AUTH, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_grpc_streams_a_generation(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        request = kvmesh_pb2.GenerateRequest(
            messages=[kvmesh_pb2.ChatMessage(role="user", content="Stream please")], max_tokens=10, temperature=0
        )
        chunks = list(stub.Generate(request, timeout=60, metadata=GRPC_AUTH))
        whole = stub.Complete(request, timeout=60, metadata=GRPC_AUTH)
        forced = kvmesh_pb2.GenerateRequest(prompt="x", max_tokens=3, temperature=0, logit_bias={1234: 100.0})
        forced_text = stub.Complete(forced, timeout=60, metadata=GRPC_AUTH).text
        with pytest.raises(grpc.RpcError) as bad:
            stub.Complete(kvmesh_pb2.GenerateRequest(prompt="x", temperature=-1), timeout=60, metadata=GRPC_AUTH)
        with pytest.raises(grpc.RpcError) as no_key:
            stub.Complete(request, timeout=60)
    detokenized = httpx.post(server.url + "/detokenize", json={"tokens": [1234] * 3}, headers=AUTH, timeout=30)
    assert forced_text == detokenized.json()["prompt"]
    assert len(chunks) == 10 and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens > 0
    assert "".join(c.text for c in chunks) == whole.text
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert no_key.value.code() == grpc.StatusCode.UNAUTHENTICATED
    target = f"127.0.0.1:{server.grpc}"
    example = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "grpc_client.py"),
            "--target",
            target,
            "--max-tokens",
            "4",
            "--api-key",
            KEY,
            "Hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert example.returncode == 0 and "[length:" in example.stdout and "unary Complete" in example.stdout


def test_grpc_carries_logprobs_and_a_json_schema(server, client):
    """The same log-probabilities as HTTP's for the same greedy request, and output constrained to a schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        scored = stub.Complete(
            kvmesh_pb2.GenerateRequest(prompt="Count to ten", max_tokens=5, temperature=0, logprobs=2),
            timeout=60,
            metadata=GRPC_AUTH,
        )
        constrained = kvmesh_pb2.GenerateRequest(
            prompt="{", max_tokens=40, temperature=1.0, seed=2, json_schema=json.dumps(schema)
        )
        shaped = stub.Complete(constrained, timeout=60, metadata=GRPC_AUTH)
    over_http = (
        client.completions.create(model=server.model, prompt="Count to ten", max_tokens=5, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    lps = scored.choices[0].logprobs
    assert len(lps) == 5 and [len(lp.top_ids) for lp in lps] == [2] * 5
    assert [round(lp.logprob, 4) for lp in lps] == [round(v, 4) for v in over_http.token_logprobs]
    assert all(lp.top_logprobs[0] >= lp.logprob - 1e-5 for lp in lps)
    assert shaped.finish_reason == "stop" and isinstance(json.loads(shaped.text)["n"], int)


def test_grpc_samples_n_sequences(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        request = kvmesh_pb2.GenerateRequest(prompt="Sample me", max_tokens=6, temperature=1.0, seed=3, n=3)
        chunks = list(stub.Generate(request, timeout=60, metadata=GRPC_AUTH))
        whole = stub.Complete(request, timeout=60, metadata=GRPC_AUTH)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Complete(kvmesh_pb2.GenerateRequest(prompt="x", n=0), timeout=60, metadata=GRPC_AUTH)
    assert sorted(c.index for c in chunks) == sorted([0, 1, 2] * 6)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.text == whole.choices[0].text
    assert ["".join(c.text for c in chunks if c.index == i) for i in range(3)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18
    assert [c.HasField("usage") for c in chunks].count(True) == 1
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_and_status_show_the_cluster(client, server):
    chat(client, server, "metrics please", max_tokens=3, temperature=0)
    time.sleep(1.5)  # replicas report with their heartbeat (1 s)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "kvmesh_time_to_first_token_seconds_count",
        "kvmesh_inter_token_latency_seconds_count",
        "kvmesh_e2e_request_latency_seconds_count",
        "kvmesh_prompt_tokens_total",
        "kvmesh_cached_prompt_tokens_total",
        "kvmesh_generation_tokens_total",
        "kvmesh_replica_kv_usage_ratio",
        "kvmesh_replica_prefix_hit_rate",
        "kvmesh_replica_requests_waiting",
        "kvmesh_replica_prefill_busy_ratio",
        "kvmesh_replica_preemptions_total",
        "kvmesh_routing_decisions_total",
        "kvmesh_index_lookup_seconds_count",
    ):
        assert name in text, name
    assert text.count("kvmesh_replica_kv_usage_ratio{") == 2

    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster.launch.cli", "status", "--url", server.url, "--api-key", KEY],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("REPLICA"))
    assert len([ln for ln in lines[header + 1 : header + 3] if ln.strip()]) == 2, out
    assert "Redis ok" in out and "kv_aware" in out and ("hit" in out or "miss" in out)


def test_sigterm_shuts_everything_down(server):
    """Must run last: it stops the module's server."""
    server.remember_processes()
    assert len(server.descendants) >= 5  # Ray's processes, the replicas, Redis
    assert server.stop(timeout_s=90) == 0, server.tail()
    deadline = time.monotonic() + 20
    while server.alive_descendants() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not server.alive_descendants()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2)
