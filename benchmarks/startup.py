"""How long ``kvmesh serve`` takes to answer, what the front door adds per request, and how long it takes to stop.

Each repeat launches ``kvmesh serve`` (own Ray, embedded Redis, N replicas, weights already cached) and
measures: launch -> "ready" printed, launch -> first chat completion answered, then the time to first
token of short streamed chat requests over HTTP, and SIGTERM -> process exit. The same prompts are then
run through an in-process ``LLMEngine`` (no Ray, no HTTP) so the front door's share of TTFT is measured
side by side on the same machine.

    kvmesh bench startup [--replicas 2] [--repeats 3] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx

from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.bench.harness.serve_process import ServeProcess

PROMPTS = [f"Question {i}: name one colour of the sea." for i in range(20)]
WARMUP = [f"Warm-up {i}: say hello." for i in range(6)]
"""Sent first (both paths), so every replica has run its first forward passes before timing starts."""


def _chat(client: httpx.Client, url: str, model: str, content: str) -> float:
    """Seconds to the first content token of one streamed chat request (on a kept-alive connection, as
    real clients do: building an httpx client costs ~25 ms here, which would be charged to the server)."""
    t0 = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError("stream ended without a token")


def one_run(model: str, replicas: int) -> dict:
    server = ServeProcess(["--model", model, "--replicas", str(replicas)])
    client = httpx.Client()
    try:
        ready_s = server.wait_ready()
        _chat(client, server.url, model, "hello")
        answer_s = time.perf_counter() - server.started_at
        for p in WARMUP:
            _chat(client, server.url, model, p)
        ttfts = [_chat(client, server.url, model, p) for p in PROMPTS]
    finally:
        client.close()
        t_stop = time.perf_counter()
        code = server.stop()
        stop_s = time.perf_counter() - t_stop
    return {
        "ready_s": ready_s,
        "first_answer_s": answer_s,
        "http_ttft_s": median(ttfts),
        "stop_s": stop_s,
        "exit_code": code,
    }


def engine_ttft(model: str) -> float:
    """The same short chats through an in-process engine: the floor the front door adds to."""
    from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=model, torch_threads=1))
    ttfts = []
    for content in [*WARMUP, *PROMPTS]:
        ids = engine.apply_chat_template([{"role": "user", "content": content}])
        t0 = time.perf_counter()
        engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0))
        while not engine.step():
            pass
        ttfts.append(time.perf_counter() - t0)
        while engine.has_unfinished:
            engine.step()
    return median(ttfts[len(WARMUP) :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="kvmesh bench startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from kvmesh.core.model_files import resolve_model_dir

    resolve_model_dir(args.model)  # weights cached before timing, as the goal states
    runs = []
    for i in range(args.repeats):
        runs.append(one_run(args.model, args.replicas))
        print(f"run {i + 1}/{args.repeats}: {runs[-1]}", file=sys.stderr, flush=True)
    floor = engine_ttft(args.model)
    summary = {k: median([r[k] for r in runs]) for k in ("ready_s", "first_answer_s", "http_ttft_s", "stop_s")}
    rows = [
        ["launch -> ready printed (s)", summary["ready_s"]],
        ["launch -> first answer (s)", summary["first_answer_s"]],
        ["SIGTERM -> exit (s)", summary["stop_s"]],
        ["TTFT over HTTP, short chat (ms)", 1000 * summary["http_ttft_s"]],
        ["TTFT in-process engine (ms)", 1000 * floor],
        ["front door adds (ms)", 1000 * (summary["http_ttft_s"] - floor)],
    ]
    print(f"\nkvmesh serve, {args.replicas} x {args.model}, medians of {args.repeats} launches")
    print_table(["measure", "value"], rows)
    write_json(
        "serve_startup",
        {
            "model": args.model,
            "replicas": args.replicas,
            "runs": runs,
            "median": summary,
            "engine_ttft_s": floor,
            "command": f"kvmesh bench startup --replicas {args.replicas} --repeats {args.repeats}",
        },
    )


if __name__ == "__main__":
    main()
