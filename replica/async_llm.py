"""``AsyncLLM``: the engine behind an asyncio API for the serving layer (add, stream, abort).

One background task owns the engine. Calls from the event loop (new requests, aborts) are queued and
applied between steps, and each step runs in a dedicated worker thread (torch releases the GIL), so the
event loop stays responsive while the model computes and the engine is never touched by two threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import RequestFailed
from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import EngineStats
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.engine import LLMEngine
from kvmesh.replica.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True, kw_only=True)
class _Add:
    """Queue a new request with the engine (unless its caller left first)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams | None
    cache_salt: str | None
    block_hashes: list[BlockHash] | None
    lora_name: str | None = None


@dataclass(slots=True, kw_only=True)
class _Abort:
    """Drop a request from the engine and free its blocks."""

    request_id: str


@dataclass(slots=True, kw_only=True)
class _Call:
    """Run ``fn`` on the engine between two steps; its result or exception goes to ``done``."""

    fn: Callable[[], Any]
    done: asyncio.Future


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmesh-engine")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list[_Add | _Abort | _Call] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        block_hashes: list[BlockHash] | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per sequence per step; leaving the iteration early aborts the
        request. ``lora_name``: the LoRA adapter it runs on (None: the base model). With ``params.n > 1`` the
        sequences' outputs interleave (``RequestOutput.index``) and the stream ends once all ``n`` have finished.
        Raises ``InvalidRequest`` for a request the engine refuses and ``RequestFailed`` if its data made a step
        fail (other requests carry on)."""
        request_id = request_id or f"async-{next(self._ids)}"
        unfinished = (params or SamplingParams()).n
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending.append(
            _Add(
                request_id=request_id,
                prompt=prompt,
                params=params,
                cache_salt=cache_salt,
                block_hashes=block_hashes,
                lora_name=lora_name,
            )
        )
        self._ensure_loop()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                unfinished -= item.finished
                if not unfinished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def stats(self) -> EngineStats:
        """The engine's state, with the requests received but not yet handed to it (they wait for the step in
        progress to end) counted as waiting: a router must not see an engine mid-step as idle. A text prompt's
        tokens are not known before it is tokenized: it counts as a request, not as tokens."""
        stats = self.engine.stats()
        adds = [op for op in tuple(self._pending) if isinstance(op, _Add)]
        lengths = [len(op.prompt) for op in adds if isinstance(op.prompt, list)]
        blocks = sum(-(-n // self.engine.block_size) for n in lengths)  # per request, as the engine's
        return dataclasses.replace(
            stats,
            num_waiting=stats.num_waiting + len(adds),
            pending_prefill_tokens=stats.pending_prefill_tokens + sum(lengths),
            waiting_blocks=stats.waiting_blocks + blocks,
            kv_free_blocks=stats.kv_free_blocks - blocks,
        )

    def abort(self, request_id: str) -> None:
        self._pending.append(_Abort(request_id=request_id))
        self._ensure_loop()

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache between two steps; False (nothing changed) while requests hold blocks."""
        return await self.between_steps(self.engine.reset_prefix_cache)

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on the engine between two steps, when no step touches it (in order with adds and
        aborts); what it returns or raises."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append(_Call(fn=fn, done=done))
        self._ensure_loop()
        return await done

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for op in pending:
            if isinstance(op, _Abort):
                self.engine.abort_request(op.request_id)
            elif isinstance(op, _Call):
                self._call(op)
            elif op.request_id in self._queues:  # else the client left before the request was queued
                try:
                    self.engine.add_request(
                        op.prompt,
                        op.params,
                        op.request_id,
                        cache_salt=op.cache_salt,
                        block_hashes=op.block_hashes,
                        lora_name=op.lora_name,
                    )
                except ValueError as exc:
                    self._queues[op.request_id].put_nowait(exc)

    @staticmethod
    def _call(op: _Call) -> None:
        if op.done.cancelled():  # its caller left
            return
        try:
            op.done.set_result(op.fn())
        except Exception as exc:
            op.done.set_exception(exc)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._apply_pending()
            if not self.engine.has_unfinished:
                if self._pending:
                    continue
                await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # a step failure no request could be blamed for: fail them all, keep serving
                log.exception("engine step failed")
                for rid in list(self._queues):
                    self.engine.abort_request(rid)
                    self._queues[rid].put_nowait(RuntimeError(f"engine step failed: {exc!r}"))
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(RequestFailed(out.error) if out.error else out)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=True)
        self.engine.close()
