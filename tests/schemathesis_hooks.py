"""Schemathesis hooks for the API fuzz test (``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``).

Schema-driven generation stays near the types the schema names; the values that broke servers in practice
sit at the edges: 2^63 and 2^64, NaN and infinities, 1e308, empty and huge strings and lists. Most
generated bodies get some of their fields, and some known ones they may lack, replaced by such values.
"""

from __future__ import annotations

import json
import math

import schemathesis
from hypothesis import strategies as st

EXTREMES = [
    2**63,
    -(2**63) - 1,
    2**64,
    2**31,
    -1,
    0,
    10**30,
    math.nan,
    math.inf,
    -math.inf,
    1e308,
    -1e308,
    5e-324,
    "",
    "x" * 100_000,
    "\x00",
    "\ud800",
    [],
    [""],
    ["x"] * 1000,
    [2**63],
    [math.nan],
    {},
    None,
    True,
]
FIELDS = [
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "user",
    "cache_salt",
    "session_id",
    "prompt",
    "messages",
    "stream",
    "ignore_eos",
]


@schemathesis.serializer("application/json")
def json_with_non_finite_numbers(ctx, value) -> bytes:
    """JSON as Python writes it: NaN and Infinity go on the wire (strict JSON has no way to say them, but
    clients built on Python's json, and FastAPI's parser, accept them)."""
    if isinstance(value, bytes):  # raw bytes from the schema's own examples go as they are
        return value
    return json.dumps(value, default=str).encode()


@schemathesis.hook
def flatmap_body(context, body):
    if not isinstance(body, dict):
        return st.just(body)
    names = sorted(set(body) | set(FIELDS))
    changes = st.dictionaries(st.sampled_from(names), st.sampled_from(EXTREMES), min_size=1, max_size=4)
    messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.sampled_from(EXTREMES)}))
    return st.one_of(
        st.just(body),
        changes.map(lambda c: {**body, **c}),
        messages.map(lambda m: {**body, "messages": m}),
    )
