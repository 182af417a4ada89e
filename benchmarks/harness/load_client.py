"""Drive a kvmesh (or any OpenAI-compatible) server with a workload and record what each request felt like.

Open loop: every session starts at its own ``start_s`` whatever the server is doing (a slow server does
not slow the arrivals down), then sends its steps one after another. ``concurrency`` switches to closed
loop instead: that many sessions at a time, back to back, start times ignored. Every request streams, so
time to first token and inter-token gaps are measured at the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvmesh.bench.harness.workloads import Session, Step


@dataclass
class Result:
    session_id: str
    step: int
    sent_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    """Send to last byte; for a failed request, send to the failure (a refusal's latency)."""
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reply: str = ""
    replica: str | None = None
    """Where a kvmesh router or ingress sent it (its ``x-kvmesh-replica`` header; other routers name none)."""
    error: str | None = None


async def _send(client: httpx.AsyncClient, model: str, session: Session, history: list[dict], step: Step) -> tuple:
    """Stream one request; returns (ttft, itls, e2e, text, usage, replica)."""
    if session.chat:
        path = "/v1/chat/completions"
        body = {"messages": [*history, {"role": "user", "content": step.text}]}
    else:
        path = "/v1/completions"
        body = {"prompt": step.token_ids if step.token_ids is not None else step.text}
    body |= {
        "model": session.model or model,
        "max_tokens": step.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "session_id": session.session_id,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft, last, itls, text, usage = None, t0, [], [], None
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
        replica = resp.headers.get("x-kvmesh-replica")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "stream error"))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if session.chat else choice.get("text")
                if piece:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itls.append(now - last)
                    last = now
                    text.append(piece)
    return ttft, itls, time.perf_counter() - t0, "".join(text), usage or {}, replica


class RoundRobin:
    """Several front doors taken in turn, request by request: a round-robin balancer in front of router instances,
    as a highly available deployment runs them."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self.clients, self.turn = clients, itertools.count()

    def stream(self, *args, **kwargs):
        return self.clients[next(self.turn) % len(self.clients)].stream(*args, **kwargs)


async def _session(client, model, session: Session, t_start: float, results: list, wait_for_start: bool) -> None:
    if wait_for_start:
        await asyncio.sleep(max(0.0, t_start + session.start_s - time.perf_counter()))
    history = [{"role": "system", "content": session.system}] if session.chat and session.system else []
    for i, step in enumerate(session.steps):
        if i and step.think_s:
            await asyncio.sleep(step.think_s)
        r = Result(session.session_id, i, time.perf_counter() - t_start)
        try:
            r.ttft_s, r.itl_s, r.e2e_s, r.reply, usage, r.replica = await _send(client, model, session, history, step)
            r.prompt_tokens = usage.get("prompt_tokens", 0)
            r.output_tokens = usage.get("completion_tokens", 0)
            r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        except Exception as exc:  # recorded, and the session stops: its history is broken
            r.error = f"{type(exc).__name__}: {exc}"[:300]
            r.e2e_s = time.perf_counter() - t_start - r.sent_at  # how long until the failure or refusal
            results.append(r)
            return
        results.append(r)
        if session.chat:
            history += [{"role": "user", "content": step.text}, {"role": "assistant", "content": r.reply}]


async def run_closed_loop(
    url: str,
    model: str,
    next_session: Callable[[float], Session | None],
    concurrency: int,
    progress_label: str = "",
    timeout_s: float = 600.0,
) -> tuple[list[Result], float]:
    """Closed loop driven by the clock: each of ``concurrency`` clients asks ``next_session(elapsed_s)`` for its
    next session and sends it as soon as its previous one ended; ``None`` stops that client. Like agents
    that wait for each answer, the offered load adapts to the server, so what changes over time is what the
    requests are, not how many are in flight."""
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        t_start = time.perf_counter()

        async def worker() -> None:
            while (session := next_session(time.perf_counter() - t_start)) is not None:
                await _session(client, model, session, t_start, results, wait_for_start=False)

        tasks = {asyncio.create_task(worker()) for _ in range(concurrency)}
        pending = tasks
        while pending:
            _, pending = await asyncio.wait(pending, timeout=5.0)
            if progress_label:
                errors = sum(r.error is not None for r in results)
                print(
                    f"  [{progress_label}] {time.perf_counter() - t_start:6.1f} s: {len(results)} requests"
                    f"{f', {errors} errors' if errors else ''}",
                    file=sys.stderr,
                    flush=True,
                )
        return results, time.perf_counter() - t_start


async def run_sessions(
    url: str | list[str],
    model: str,
    sessions: list[Session],
    concurrency: int | None = None,
    progress_label: str = "",
    timeout_s: float = 600.0,
) -> tuple[list[Result], float]:
    """Run every session; returns the results and the wall time from the first send to the last reply. Several
    ``url``: each request goes to the next in turn (``RoundRobin``)."""
    results: list[Result] = []
    total = sum(len(s.steps) for s in sessions)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    urls = [url] if isinstance(url, str) else url
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=u, timeout=timeout_s, limits=limits))
            for u in urls
        ]
        client = clients[0] if len(clients) == 1 else RoundRobin(clients)
        t_start = time.perf_counter()
        if concurrency:
            queue = list(sessions)

            async def worker() -> None:
                while queue:
                    await _session(client, model, queue.pop(0), t_start, results, wait_for_start=False)

            tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        else:
            tasks = [asyncio.create_task(_session(client, model, s, t_start, results, True)) for s in sessions]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=5.0)
            if progress_label:
                errors = sum(r.error is not None for r in results)
                print(
                    f"  [{progress_label}] {time.perf_counter() - t_start:6.1f} s: {len(results)}/{total} requests"
                    f"{f', {errors} errors' if errors else ''}",
                    file=sys.stderr,
                    flush=True,
                )
        return results, time.perf_counter() - t_start
