"""Tools through ``kvmesh serve`` with the official ``openai`` client and a real agent framework, on a tiny
random Qwen3 whose Qwen-style template renders tools (``tests/qwen_style.py``).

A random model writes no sensible calls of its own, so the calls here are forced (``tool_choice`` required
or named, by structured output): every one must parse and validate against its function's schema. The
parsing of calls a model writes itself is tested on fixed texts in ``test_tool_calls.py``.
"""

from __future__ import annotations

import json
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
import requests

from kvmesh.bench.harness.serve_process import ServeProcess
from tests.qwen_style import save_tiny_qwen

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "tools-e2e-key"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
OSLO = '{"city": "Oslo"}'


@pytest.fixture(scope="module")
def server(smollm_dir, tmp_path_factory):
    model = save_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"), smollm_dir)
    args = ["--model", str(model), "--replicas", "1", "--threads", "1", "--max-num-seqs", "8", "--api-key", KEY]
    with ServeProcess(args, tmp_path_factory.mktemp("serve") / "serve.log") as srv:
        srv.model = str(model)
        srv.wait_ready(timeout_s=180)
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its function's schema."""
    calls = []
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        calls.append((call.function.name, args))
    return calls


def test_the_template_renders_tools_calls_and_results(server):
    """The prompt the model sees: the tools in its system turn, an earlier call, and the tool's result."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"},
    ]
    url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
    tokens = requests.post(
        f"{url}/tokenize", json={"messages": history, "tools": TOOLS}, headers=auth, timeout=30
    ).json()["tokens"]
    text = requests.post(f"{url}/detokenize", json={"tokens": tokens}, headers=auth, timeout=30).json()["prompt"]
    assert "<tools>" in text and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12 C and rain\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_tool_choice_required_always_yields_valid_calls(client, server):
    for seed in range(10):
        reply = client.chat.completions.create(
            model=server.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,  # a random model would add calls until max_tokens
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(valid_calls(choice.message)) == 1


def test_a_named_function_is_called_and_streamed_calls_match_whole(client, server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"model": server.model, "messages": ASK, "tools": TOOLS, "tool_choice": named, "seed": 3, "max_tokens": 80}
    whole = client.chat.completions.create(**kw, temperature=1.0)
    [(name, args)] = valid_calls(whole.choices[0].message)
    assert name == "get_weather" and set(args) == {"city", "unit"}
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**kw, temperature=1.0, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [(name, args)]
    assert reasons[-1] == "tool_calls"


def test_a_tool_round_trip_ends_in_an_answer(client, server):
    """Call, run the tool, send its result back: the model answers with text (tool_choice none)."""
    first = client.chat.completions.create(
        model=server.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    ).choices[0]
    history = [*ASK, first.message.model_dump(exclude_none=True)]
    for call in first.message.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "12 C and rain"})
    final = client.chat.completions.create(
        model=server.model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    ).choices[0]
    assert final.message.tool_calls is None and final.message.content and final.finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:  # a forced call cannot also follow a response_format
        client.chat.completions.create(
            model=server.model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert bad.value.body["param"] == "response_format"


def test_tools_over_grpc_whole_and_streamed(server):
    """gRPC carries tools as JSON text and returns typed calls: a forced call validates, the stream's calls
    equal the whole answer's, and a history with the call and its result gets a text answer."""
    from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc

    auth = (("authorization", f"Bearer {KEY}"),)
    ask = [kvmesh_pb2.ChatMessage(role="user", content=ASK[0]["content"])]
    request = kvmesh_pb2.GenerateRequest(
        messages=ask,
        tools_json=json.dumps(TOOLS),
        tool_choice="get_weather",
        max_tokens=80,
        temperature=1.0,
        seed=4,
    )
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc}") as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        whole = stub.Complete(request, timeout=60, metadata=auth)
        streamed = list(stub.Generate(request, timeout=60, metadata=auth))
        [call] = whole.choices[0].tool_calls
        history = [
            *ask,
            kvmesh_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            kvmesh_pb2.ChatMessage(role="tool", tool_call_id=call.id, content="12 C and rain"),
        ]
        answer = stub.Complete(
            kvmesh_pb2.GenerateRequest(
                messages=history, tools_json=json.dumps(TOOLS), tool_choice="none", max_tokens=6, temperature=0
            ),
            timeout=60,
            metadata=auth,
        )
        with pytest.raises(grpc.RpcError) as bad:
            stub.Complete(kvmesh_pb2.GenerateRequest(messages=ask, tools_json="{not json"), timeout=60, metadata=auth)
    assert call.name == "get_weather" and whole.finish_reason == "tool_calls" and whole.text == ""
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert [(c.name, c.arguments) for ch in streamed for c in ch.tool_calls] == [(call.name, call.arguments)]
    assert answer.text and not answer.choices[0].tool_calls and answer.finish_reason == "length"
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.value.details().startswith("tools")


def test_an_openai_agents_sdk_agent_completes_a_tool_using_run(server):
    """The OpenAI Agents SDK over Chat Completions: the agent must call the tool (first turn, required),
    the SDK runs it and sends the result back, and the second turn (tool_choice back to auto) answers."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    seen: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Rome", "Lima"]) -> str:  # an enum: a random model's strings run long
        """Current weather in a city."""
        seen.append({"city": city})
        return f"12 C and rain in {city}"

    model = agents.OpenAIChatCompletionsModel(
        model=server.model, openai_client=AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=1.0, extra_body={"seed": 5}
        ),
    )
    result = agents.Runner.run_sync(
        agent, "What is the weather in Oslo?", run_config=agents.RunConfig(tracing_disabled=True)
    )
    assert len(seen) == 1 and seen[0]["city"] in ("Oslo", "Rome", "Lima")
    assert isinstance(result.final_output, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
