"""The per-replica paged KV engine: ``LLM`` for batch use, ``AsyncLLM`` for serving."""

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.messages import EngineStats
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.engine import LLMEngine
from kvmesh.replica.llm import LLM
from kvmesh.replica.outputs import RequestOutput

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
