"""Tool calling for the chat API: a request's ``tools`` and ``tool_choice`` checked, the conversation rendered
with them, and the model's tool-call syntax parsed into OpenAI's ``tool_calls``, whole and streamed alike.

Two syntaxes, chosen from the model's chat template: Hermes (``<tool_call>{"name", "arguments"}</tool_call>``,
as Qwen2/3, Hermes and most ChatML models write it) and Llama 3's JSON (``{"name", "parameters"}``, optionally
after ``<|python_tag|>``). A template that does not render tools gets them in a Hermes-style system message
written here, so any chat model can be offered tools.

``tool_choice`` ``required`` and a named function are forced by structured output, as vLLM does: the reply
is constrained to a JSON array of calls (``required``) or to the function's arguments (named), so it always
parses into valid calls. ``auto`` lets the model choose and parses what it writes; ``none`` renders no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.cluster.protocol.api_errors import APIError

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
CALL_OPEN, CALL_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape: a string the client parses)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        """The call as a ``tool_calls`` entry; ``index`` for stream deltas."""
        entry = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: the functions offered and how the model may use them."""

    functions: list[dict]
    """Each tool's ``function`` object: ``name``, optional ``description`` and ``parameters`` (a JSON schema)."""
    choice: Literal["auto", "required", "named"]
    name: str | None = None
    """The function ``tool_choice`` names (choice ``named``)."""
    parallel: bool = True
    """``parallel_tool_calls``: False allows one call per reply (a forced reply holds one; parsing keeps the first)."""

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def forced_schema(self) -> str | None:
        """The JSON schema the reply is constrained to when the model must call (None under ``auto``)."""
        if self.choice == "named":
            return json.dumps(_parameters(next(f for f in self.functions if f["name"] == self.name)))
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                }
                for f in self.functions
            ]
            bounds = {"minItems": 1} if self.parallel else {"minItems": 1, "maxItems": 1}
            return json.dumps({"type": "array", **bounds, "items": {"anyOf": calls}})
        return None


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def check_tools(
    tools: list[Any] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None = None
) -> ToolRequest | None:
    """The request's tools as a ``ToolRequest``, None when none are offered or ``tool_choice`` is ``none``;
    400 naming the field for a malformed tool, a duplicate name, or a choice naming no offered tool."""
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise APIError("tool_choice must be none, auto, required or a named function", param="tool_choice")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions.append(fn)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", param="tools")
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "auto"):
        return ToolRequest(functions, "auto", parallel=parallel)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolRequest(functions, "required", parallel=parallel)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolRequest(functions, "named", name, parallel)
    raise APIError(f"tool_choice {tool_choice!r}: none, auto, required or a named function", param="tool_choice")


# ---------------------------------------------------------------------------------------------- rendering
def template_syntax(template: str | None) -> str | None:
    """The tool-call syntax a chat template teaches its model, or None when it renders no tools."""
    if not template or "tools" not in template:
        return None
    return LLAMA3_JSON if PYTHON_TAG in template or "ipython" in template else HERMES


def tools_system_text(functions: list[dict]) -> str:
    """The Hermes-style instructions that offer ``functions`` to a model whose template cannot."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "You can call functions to help with the user's request. The functions, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, reply with a JSON object holding its name and arguments inside tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}'
    )


def template_messages(messages: list[dict], tools: ToolRequest | None, syntax: str | None) -> list[dict]:
    """``messages`` as the template takes them. A template that renders tools gets assistant ``tool_calls``
    with their arguments as objects (as templates index them); one that does not gets the calls written into
    the assistant's text in Hermes syntax, tool results as ``tool`` turns, and the tools in a system message."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
        elif syntax is not None:
            listed = [{**c, "function": {**c["function"], "arguments": _as_object(c["function"])}} for c in calls]
            out.append({**m, "tool_calls": listed})
        else:
            text = "".join(
                f"{CALL_OPEN}\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _as_object(c["function"])})
                + f"\n{CALL_CLOSE}"
                for c in calls
            )
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": (m["content"] or "") + text})
    if tools is not None and syntax is None:
        system = tools_system_text(tools.functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _as_object(function: dict) -> Any:
    """A call's ``arguments`` (JSON text in OpenAI's shape) as a value; text that is not JSON stays text."""
    args = function.get("arguments")
    if not isinstance(args, str):
        return args if args is not None else {}
    try:
        return json.loads(args)
    except ValueError:
        return args


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class Event:
    """What a reply's text turned out to hold: ``content`` text or one tool ``call``."""

    content: str = ""
    call: ToolCall | None = None


def _call_from(obj: Any, names: set[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolCallStream:
    """Parses one choice's reply as it streams: ``feed`` each piece of text, ``finish`` at the end; each
    returns the events that piece completes. Text that may begin a call is held back until it is known; a
    call that does not parse (bad JSON, an unknown function) is given back as content, so nothing is lost.
    Whole replies go through the same object, so streamed and whole responses agree."""

    def __init__(self, tools: ToolRequest, syntax: str | None) -> None:
        self.tools, self.syntax = tools, syntax or HERMES
        self.held = ""
        self.whole_reply = tools.choice != "auto" or self.syntax == LLAMA3_JSON
        """Forced calls are the whole reply; Llama 3 JSON is decided by the reply's first character."""
        self.decided = tools.choice != "auto" or self.syntax == HERMES
        self.space = ""  # whitespace withheld: between or around calls it is not content
        self.calls = 0

    def feed(self, text: str) -> list[Event]:
        self.held += text
        if not self.decided:  # Llama 3 JSON under auto: a reply that opens with a call is one
            stripped = self.held.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return []
            self.decided = True
            self.whole_reply = stripped.startswith(("{", PYTHON_TAG))
        if self.whole_reply:
            return []
        return self._hermes(final=False)

    def finish(self) -> list[Event]:
        if not self.whole_reply:
            return self._hermes(final=True) + self._content("", final=True)
        text, self.held = self.held, ""
        calls = self._whole_calls(text)
        if calls is None:
            return self._content(text, final=True)
        self.calls += len(calls)
        return [Event(call=c) for c in calls]

    def _whole_calls(self, text: str) -> list[ToolCall] | None:
        tools, names = self.tools, self.tools.names
        try:
            value = json.loads(text.strip().removeprefix(PYTHON_TAG)) if text.strip() else None
        except ValueError:
            value = None
            if self.syntax == LLAMA3_JSON and tools.choice == "auto":  # several calls joined by ';'
                try:
                    value = [json.loads(part) for part in text.strip().removeprefix(PYTHON_TAG).split(";")]
                except ValueError:
                    return None
        if tools.choice == "named":
            return None if value is None else [ToolCall(tools.name, json.dumps(value))]
        items = value if isinstance(value, list) else [value]
        calls = [_call_from(item, names, "parameters") for item in items]
        return calls if calls and all(calls) else None

    def _hermes(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            start = self.held.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self.held, CALL_OPEN)
                cut = len(self.held) - keep
                events += self._content(self.held[:cut])
                self.held = self.held[cut:]
                return events
            events += self._content(self.held[:start])
            self.held = self.held[start:]
            end = self.held.find(CALL_CLOSE)
            if end < 0 and not final:
                return events
            body = self.held[len(CALL_OPEN) : end if end >= 0 else None]
            raw = self.held[: end + len(CALL_CLOSE)] if end >= 0 else self.held
            self.held = self.held[len(raw) :]
            try:
                call = _call_from(json.loads(body), self.tools.names, "arguments")
            except ValueError:
                call = None
            if call is None:
                events += self._content(raw)
            else:
                self.space, self.calls = "", self.calls + 1
                events.append(Event(call=call))
            if end < 0:
                return events

    def _content(self, text: str, final: bool = False) -> list[Event]:
        """Content, with whitespace held until text follows it (whitespace around calls is dropped)."""
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if final:
            body, self.space = (body if self.calls else body + self.space), ""
        return [Event(content=body)] if body else []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may be the start of a call)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolReplies:
    """The replies of one chat request with tools: a ``ToolCallStream`` per choice, turning each choice's
    text into content and ``tool_calls`` entries; a choice that called a tool and stopped finishes with
    ``tool_calls`` (OpenAI's reason), one cut short keeps ``length``."""

    def __init__(self, tools: ToolRequest, syntax: str | None, n: int) -> None:
        self.streams = [ToolCallStream(tools, syntax) for _ in range(n)]

    def feed(self, index: int, text: str, finish_reason: str | None) -> tuple[str, list[dict] | None, str | None]:
        """A streamed chunk of choice ``index``: its content, its completed calls (delta entries, numbered
        within the choice) and its finish reason."""
        stream = self.streams[index]
        before = stream.calls
        events = stream.feed(text) + (stream.finish() if finish_reason else [])
        calls = [e.call.as_dict(before + i) for i, e in enumerate(e for e in events if e.call)]
        calls = calls[: max(1 - before, 0)] if not stream.tools.parallel else calls
        return "".join(e.content for e in events), calls or None, self._reason(stream, finish_reason)

    def whole(
        self, texts: list[str], finish_reasons: list[str | None]
    ) -> tuple[list[str], list[list[dict]], list[str | None]]:
        """Whole replies: each choice's content, calls and finish reason."""
        contents, calls, reasons = [], [], []
        for stream, text, reason in zip(self.streams, texts, finish_reasons, strict=True):
            events = stream.feed(text) + stream.finish()
            contents.append("".join(e.content for e in events))
            made = [e.call.as_dict() for e in events if e.call]
            calls.append(made if stream.tools.parallel else made[:1])
            reasons.append(self._reason(stream, reason))
        return contents, calls, reasons

    @staticmethod
    def _reason(stream: ToolCallStream, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and stream.calls else finish_reason
