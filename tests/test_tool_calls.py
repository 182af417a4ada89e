"""Tool calls: checking a request's tools, rendering them, and parsing model replies, on fixed texts."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCallStream,
    check_tools,
    template_messages,
    template_syntax,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def parse(text: str, syntax: str | None = HERMES, choice="auto", pieces: int = 1, seed: int = 0):
    """(content, [(name, arguments)]) of ``text`` fed in ``pieces`` random cuts."""
    stream = ToolCallStream(check_tools(TOOLS, choice), syntax)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces - 1, len(text) - 1))) if len(text) > 1 else []
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += stream.feed(text[a:b])
    events += stream.finish()
    content = "".join(e.content for e in events)
    return content, [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call]


HERMES_CASES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
    ),
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    # Malformed JSON and an unknown function come back as content: nothing the model wrote is lost.
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    # A call the model did not close before it stopped still counts when its JSON is whole.
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", [("get_time", {})]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_hermes_replies_parse_the_same_whole_and_streamed(text, content, calls, pieces):
    for seed in range(5):
        assert parse(text, HERMES, pieces=pieces, seed=seed) == (content, calls)


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    (
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
        "",
        [("get_time", {}), ("get_weather", {"city": "Rome"})],
    ),
    ("It is sunny in {city}.", "It is sunny in {city}.", []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_llama3_json_replies_parse_the_same_whole_and_streamed(text, content, calls, pieces):
    assert parse(text, LLAMA3_JSON, pieces=pieces) == (content, calls)


def test_forced_replies_parse_into_calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse('{"city": "Oslo"}', choice=named, pieces=3) == ("", [("get_weather", {"city": "Oslo"})])
    required = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert parse(required, choice="required", pieces=5) == ("", [("get_time", {}), ("get_weather", {"city": "Rome"})])
    assert parse('{"city": ', choice=named) == ('{"city": ', [])  # cut short by max_tokens: the text, no call


def test_forced_schemas_only_admit_valid_calls():
    jsonschema = pytest.importorskip("jsonschema")
    required = json.loads(check_tools(TOOLS, "required").forced_schema())
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    named = json.loads(check_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}).forced_schema())
    assert named == WEATHER["function"]["parameters"]


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function"}], None, "tools"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
        ([WEATHER, WEATHER], None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": "get_time"}, "tool_choice"),
        (TOOLS, 7, "tool_choice"),
        (["get_time"], None, "tools"),
        (None, "required", "tool_choice"),
    ],
)
def test_malformed_tools_are_a_400_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as err:
        check_tools(tools, choice)
    assert err.value.status == 400 and err.value.param == param


def test_no_tools_or_tool_choice_none_render_no_tools():
    assert check_tools(None, None) is None and check_tools(TOOLS, "none") is None
    assert check_tools(TOOLS, None).choice == "auto"


def test_template_syntax_is_read_from_the_template():
    assert template_syntax("{{ messages }}") is None
    assert template_syntax("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert template_syntax("{% if tools %}Environment: ipython<|python_tag|>{% endif %}") == LLAMA3_JSON


def test_a_template_without_tools_gets_them_in_a_system_message_and_calls_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
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
        {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"},
    ]
    out = template_messages(history, check_tools(TOOLS, None), None)
    assert out[0]["content"].startswith("Be brief.") and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert "tool_calls" not in out[2] and out[3] == history[3]
    # A template that renders tools itself gets the calls with their arguments as objects.
    native = template_messages(history, check_tools(TOOLS, None), HERMES)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"} and native[0] == history[0]
