"""Per-request generation settings, validated at construction so bad input fails before it is queued."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_N = 16
"""The most sequences one request may ask for (``n``): each costs a running slot and its own KV blocks."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``max_tokens=None`` generates until a stop condition or the
    model's context is full. ``seed`` makes a sampled request reproducible regardless of what else is
    batched with it (each seeded request owns its random generator).

    ``n`` asks for that many sequences from one prompt (parallel sampling). The prompt is prefilled once and
    its KV blocks are shared by the ``n`` sequences (copy-on-write, see ``KVCacheManager``). Sequence ``i``
    samples with ``seed + i`` when a seed is given, so each one is reproducible and sequence 0 equals the
    ``n=1`` request with the same seed; greedy sequences are all identical.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
