"""The per-replica paged KV engine: ``LLM`` for batch use, ``AsyncLLM`` for serving."""

from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.engine import LLMEngine
from kvmesh.replica.llm import LLM
from kvmesh.replica.outputs import RequestOutput
from kvmesh.shared.engine_config import EngineConfig
from kvmesh.shared.messages import EngineStats
from kvmesh.shared.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
