"""The per-replica paged KV engine: ``LLM`` for batch use, ``AsyncLLM`` for serving.

Exports load lazily, so torch-free modules of this package (``replica.model_files``) can be imported by
the ingress without pulling in torch and the model code.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "AsyncLLM": "replica.async_llm",
    "EngineConfig": "replica.config",
    "EngineStats": "replica.telemetry",
    "LLMEngine": "replica.engine",
    "RequestOutput": "replica.outputs",
    "LLM": "replica.llm",
    "SamplingParams": "replica.sampling_params",
}
__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from replica.async_llm import AsyncLLM
    from replica.config import EngineConfig
    from replica.engine import LLMEngine
    from replica.llm import LLM
    from replica.outputs import RequestOutput
    from replica.sampling_params import SamplingParams
    from replica.telemetry import EngineStats


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'replica' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
