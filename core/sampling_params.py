"""Per-request generation settings, validated at construction (``core/limits.py``) so bad input fails
before it is queued."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidRequest
from kvmesh.core.limits import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    SEED_RANGE,
    check_float,
    check_int,
    check_text,
)

JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})
"""What ``response_format: {"type": "json_object"}`` asks for: any JSON object."""
MAX_SCHEMA_CHARS = 64 << 10
"""Characters of a ``response_format`` JSON schema."""
MAX_LOGPROBS = 20
"""Most likely alternatives reported per token (OpenAI's chat limit)."""
MAX_PENALTY = 2.0
"""Presence and frequency penalties lie in [-2, 2] (OpenAI's range)."""
MAX_N = 16
"""The most sequences one request may ask for (``n``): each costs a running slot and its own KV blocks."""
MAX_TEMPERATURE = 100.0
"""Beyond a few units every temperature samples almost uniformly; the bound keeps the value finite."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: dividing logits by less overflows fp32 (vLLM does the same)."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``max_tokens=None`` generates until a stop condition or the
    model's context is full. ``seed`` makes a sampled request reproducible regardless of what else is
    batched with it (each seeded request owns its random generator).

    ``logit_bias`` (token id -> -100..100) is added to the logits before temperature and every cut, as
    OpenAI and vLLM do; -100 in effect bans a token. ``presence_penalty`` / ``frequency_penalty`` lower the
    logits of tokens the sequence has generated (``replica/penalties.py``), also before temperature.
    ``min_tokens``: the stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are banned until
    that many tokens were generated.

    ``n`` asks for that many sequences from one prompt (parallel sampling). The prompt is prefilled once and
    its KV blocks are shared by the ``n`` sequences (copy-on-write, see ``KVCacheManager``). Sequence ``i``
    samples with ``seed + i`` when a seed is given, so each one is reproducible and sequence 0 equals the
    ``n=1`` request with the same seed; greedy sequences are all identical.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` x the most likely one (0: off)."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated so far (-2 to 2, OpenAI's range)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far (-2 to 2)."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Report each generated token's log-probability and this many most likely alternatives (0: none);
    None: no log-probabilities."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability (given the tokens before it; the first has none) and this
    many most likely alternatives; None: none. Such a request's prompt is computed in full (no prefix-cache
    hits), so every position has logits."""
    json_schema: str | None = None
    """Constrain the output to JSON valid under this schema (JSON text; ``replica/structured.py``)."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_float("min_p", self.min_p, 0.0, 1.0)
        check_int("top_k", self.top_k, 0, MAX_TOKENS_LIMIT)
        if self.seed is not None:
            check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
        for s in self.stop:
            check_text("stop", s, MAX_STOP_CHARS)
            if not s:
                raise InvalidRequest("stop strings must be non-empty", "stop")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0, MAX_TOKENS_LIMIT)
        check_int("n", self.n, 1, MAX_N)
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
        for token, bias in self.logit_bias.items():
            check_int("logit_bias", token, 0, MAX_TOKENS_LIMIT)
            check_float("logit_bias", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        check_float("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_float("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.json_schema is not None:
            check_text("response_format", self.json_schema, MAX_SCHEMA_CHARS)
            try:
                schema = json.loads(self.json_schema)
            except ValueError:
                schema = None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format: the JSON schema must be a JSON object", "response_format")
        check_int(
            "min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else MAX_TOKENS_LIMIT
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean", name)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a step must do more than sample for this request: bias, ban, mask or report logprobs."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.logprobs is not None
            or self.json_schema is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
