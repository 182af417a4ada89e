"""Bounds on everything a client sends, and the error that names the field out of bounds.

One set of checks serves HTTP, gRPC and ``LLMEngine.add_request``: ``SamplingParams`` checks its own fields
when built (model-free), ``check_for_model`` adds what needs the model (vocabulary, context), and
``check_request_fields`` the request's strings. Torch-free: the ingress imports it.
"""

from __future__ import annotations

import math

from kvmesh.core.errors import InvalidRequest

MAX_STOP_STRINGS = 16
"""Stop strings per request (OpenAI allows 4); each is searched for after every token."""
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
"""Entries of ``logit_bias`` (OpenAI's limit)."""
LOGIT_BIAS_RANGE = 100.0
"""``logit_bias`` values lie in [-100, 100]: -100 bans a token, +100 all but forces it (OpenAI's range)."""
MAX_ID_CHARS = 256
"""``session_id``, ``user``, ``cache_salt`` and request ids: routers keep session ids in memory."""
MAX_MESSAGES = 4096
"""Chat messages per request; their combined size is bounded by the context (``prompt_byte_limit``)."""
SEED_RANGE = (-(2**63), 2**64)
"""Seeds are taken modulo 2**64, so a signed or unsigned 64-bit seed keeps its meaning; nothing wider."""
MAX_TOKENS_LIMIT = 2**31 - 1


def check_int(name: str, value: object, low: int, high: int) -> None:
    """``value`` is an int (not a bool) with ``low <= value <= high``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}, got {value}", name)


def check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """``value`` is a finite number with ``low <= value <= high`` (``low < value`` when ``low_open``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {type(value).__name__}", name)
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number, got {value}", name)
    if value > high or value < low or (low_open and value == low):
        bounds = f"in ({low}, {high}]" if low_open else f"between {low} and {high}"
        raise InvalidRequest(f"{name} must be {bounds}, got {value}", name)


def check_text(name: str, value: object, max_chars: int = MAX_ID_CHARS) -> None:
    """``value`` is None or a string of at most ``max_chars`` characters."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}", name)
    if len(value) > max_chars:
        raise InvalidRequest(f"{name} must be at most {max_chars} characters, got {len(value)}", name)


def check_request_fields(**fields: object) -> None:
    """The request's identifying strings (``session_id``, ``user``, ``cache_salt``, ``request_id``)."""
    for name, value in fields.items():
        check_text(name, value)


def check_for_model(params, vocab_size: int) -> None:
    """What ``SamplingParams`` cannot check alone: ids and ``top_k`` within the model's vocabulary."""
    if params.top_k > vocab_size:
        raise InvalidRequest(f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}", "top_k")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{name} must hold token ids below {vocab_size}, got {bad[0]}", name)


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not ids:
        raise InvalidRequest("prompt is empty", param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidRequest(f"prompt contains token ids outside the vocabulary (0..{vocab_size - 1})", param)


def prompt_byte_limit(max_model_len: int, max_token_bytes: int) -> int:
    """UTF-8 bytes of text that cannot fit ``max_model_len`` tokens when no token spans more than
    ``max_token_bytes`` bytes: text over it is refused before it is tokenized (its bytes are counted, not its
    characters: one character may be four bytes). Doubled for normalisers that shrink text before splitting
    it."""
    return 2 * max_model_len * max(1, max_token_bytes)


def request_body_limit(max_model_len: int, max_token_bytes: int) -> int:
    """Default HTTP/gRPC body limit: the largest prompt that could fit the context, JSON-escaped (up to
    6 bytes per byte of text), plus room for everything else in the body."""
    return 6 * prompt_byte_limit(max_model_len, max_token_bytes) + (256 << 10)
