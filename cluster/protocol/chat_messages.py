"""Chat messages as the model's chat template takes them: one translation for HTTP and gRPC.

OpenAI's ``developer`` role is its newer name for ``system``; chat templates know only ``system``, so a
``developer`` message reaches the template as ``system`` whichever API it came through. Tool calls of
earlier assistant turns and the ids of tool results are kept, in OpenAI's shape, for templates that render
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from kvmesh.cluster.protocol.api_errors import APIError

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)
TEMPLATE_ROLE = {"developer": "system"}
"""Roles a chat template is given under another name."""


@dataclass(slots=True, kw_only=True)
class HistoryToolCall:
    """A tool call an earlier assistant turn made, sent back in the history."""

    id: str
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


def template_message(
    *, role: str, content: str, tool_calls: Sequence[HistoryToolCall] = (), tool_call_id: str | None = None
) -> dict:
    """One message as chat templates take it; a 400 naming ``messages`` for a role OpenAI does not define or
    tool calls on anything but an assistant turn."""
    if role not in CHAT_ROLES:
        raise APIError(f"messages: role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages")
    if tool_calls and role != "assistant":
        raise APIError("messages: only assistant messages carry tool_calls", param="messages")
    out: dict = {"role": TEMPLATE_ROLE.get(role, role), "content": content}
    if tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in tool_calls
        ]
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out
