"""Sampling parameters from the fields a request names, for HTTP and gRPC alike: one translation, one set
of bounds (``SamplingParams`` checks them), one error naming the field out of range."""

from __future__ import annotations

from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.core.errors import InvalidRequest
from kvmesh.core.sampling_params import SamplingParams


def sampling_params(top_k: int | None = None, stop: str | list[str] | None = None, **fields) -> SamplingParams:
    """``SamplingParams`` from API fields (HTTP and gRPC alike): fields left out or None keep their defaults
    (except ``max_tokens=None``: no limit), ``top_k`` -1 means off (vLLM's convention), and an out-of-range
    value becomes a 400 naming the field."""
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    try:
        return SamplingParams(
            **fields,
            top_k=0 if top_k in (None, -1) else top_k,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
        )
    except InvalidRequest as exc:
        raise APIError(str(exc), param=exc.param) from exc
