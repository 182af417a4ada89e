"""``LLM``: the offline, batch API (``from replica import LLM, SamplingParams``)."""

from __future__ import annotations

from replica.config import EngineConfig
from replica.engine import EngineStats, LLMEngine, RequestOutput
from replica.model_files import DEFAULT_MODEL
from replica.sampling_params import SamplingParams


class LLM:
    """Generate for many prompts at once through the continuous-batching engine.

    Extra keyword arguments are ``EngineConfig`` fields (``device``, ``dtype``, ``max_model_len``,
    ``kv_cache_bytes``, ``torch_threads``).
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        **engine_kwargs,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                **engine_kwargs,
            )
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs in the order of ``prompts`` (a single prompt may be passed bare); a prompt whose
        params ask for ``n`` sequences contributes ``n`` outputs in a row, by ``index``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        param_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        wanted = [(rid, i) for rid, sp in zip(ids, param_list, strict=True) for i in range(sp.n)]
        final: dict[tuple[str, int], RequestOutput] = {}
        while len(final) < len(wanted):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [final[key] for key in wanted]

    def stats(self) -> EngineStats:
        return self.engine.stats()
