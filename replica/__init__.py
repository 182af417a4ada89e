"""The per-replica paged KV engine: ``LLM`` for batch use, ``AsyncLLM`` for serving."""

from replica.async_llm import AsyncLLM
from replica.config import EngineConfig
from replica.engine import EngineStats, LLMEngine, RequestOutput
from replica.llm import LLM
from replica.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
