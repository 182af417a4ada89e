"""``LLM``: the offline, batch API (``from replica import LLM, SamplingParams``)."""

from __future__ import annotations

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.messages import EngineStats
from kvmesh.core.model_files import DEFAULT_MODEL
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.engine import LLMEngine
from kvmesh.replica.outputs import RequestOutput


class LLM:
    """Generate for many prompts at once through the continuous-batching engine.

    Keyword arguments are ``EngineConfig`` fields (``block_size``, ``num_kv_blocks``, ``max_num_seqs``,
    ``device``, ``dtype``, ``torch_threads``, ...), with ``EngineConfig``'s defaults.

    It closes like a file (``close()``, or ``with LLM(...) as llm:``): closing releases the engine, and with a
    ``disk_cache_dir`` writes what it caches there and frees the directory, so the next ``LLM`` on it, in this
    process or another, takes the same slot and starts warm.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the engine (``LLMEngine.close``); a second call does nothing."""
        self.closed = True
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora: str | list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Final outputs in the order of ``prompts`` (a single prompt may be passed bare); a prompt whose
        params ask for ``n`` sequences contributes ``n`` outputs in a row, by ``index``. With ``logprobs``,
        each output carries one per generated token; with ``prompt_logprobs``, one per prompt token after the
        first. ``lora``: the adapter each prompt runs on (one name for all; None: the base model). Raises
        ``ValueError`` once closed."""
        if self.closed:
            raise ValueError("generate on a closed LLM")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        param_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} adapters")
        ids = [self.engine.add_request(p, sp, lora_name=a) for p, sp, a in zip(prompts, param_list, loras, strict=True)]
        wanted = [(rid, i) for rid, sp in zip(ids, param_list, strict=True) for i in range(sp.n)]
        final: dict[tuple[str, int], RequestOutput] = {}
        logprobs: dict[tuple[str, int], list] = {}
        prompt_logprobs: dict[tuple[str, int], list] = {}
        while len(final) < len(wanted):
            for out in self.engine.step():
                key = out.request_id, out.index
                if out.logprobs is not None:
                    logprobs.setdefault(key, []).extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[key] = out.prompt_logprobs
                if out.finished:
                    final[key] = out
                    out.logprobs = logprobs.pop(key, None)  # the whole output's, not its last step's
                    out.prompt_logprobs = prompt_logprobs.pop(key, None)
        return [final[key] for key in wanted]

    def stats(self) -> EngineStats:
        return self.engine.stats()
