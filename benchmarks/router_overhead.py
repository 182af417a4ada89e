"""A router's own CPU per request and per streamed token, in front of one ``kvmesh engine``.

    kvmesh bench router_overhead [--smg /work/peers/smg-venv/bin/smg] [--requests 30]

Starts one engine, then each router in turn (``kvmesh router``; SGLang's ``smg --policy cache_aware`` when
given) and sends the same chat request (a ~500-token prompt, cached after the first) one at a time with
``max_tokens`` 1, 16 and 64, streamed. The router process's CPU seconds over each series, divided by the
requests, give its cost per request; the slope over ``max_tokens`` its cost per streamed token (what relaying
the stream takes), the intercept what a request costs before and around its tokens. Medians of ``--repeats``
series. Prints a table and writes ``benchmarks/results/router_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from kvmesh.bench.harness.peer_fleet import MODEL, cpu_seconds, start_engines, start_router
from kvmesh.bench.harness.report import print_table, write_json

MAX_TOKENS = (1, 16, 64)
DOCUMENT = " ".join(f"Sentence {i} tells a small fact about topic {i % 7}." for i in range(40))


def series(client: httpx.Client, url: str, pid: int, max_tokens: int, requests: int) -> tuple[float, float]:
    """Router CPU seconds and tokens streamed per request over ``requests`` sequential streamed chat requests."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": DOCUMENT}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    cpu0, tokens = cpu_seconds(pid), 0
    for _ in range(requests):
        with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    tokens += json.loads(line[6:])["usage"]["completion_tokens"]
    return (cpu_seconds(pid) - cpu0) / requests, tokens / requests


def measure(kind: str, args: argparse.Namespace, engines: list) -> dict:
    """One router's CPU per request at each of ``MAX_TOKENS`` (medians of the repeats) and per streamed token
    (the slope between the shortest and the longest answers)."""
    router = start_router(kind, args, engines)
    try:
        with httpx.Client(timeout=120) as client:
            series(client, router.url, router.proc.pid, 4, 3)  # warm: the prompt cached, connections open
            runs = {
                n: [series(client, router.url, router.proc.pid, n, args.requests) for _ in range(args.repeats)]
                for n in MAX_TOKENS
            }
    finally:
        router.stop()
    cpu = {n: statistics.median(c for c, _ in v) for n, v in runs.items()}
    tokens = {n: statistics.median(t for _, t in v) for n, v in runs.items()}
    first, last = MAX_TOKENS[0], MAX_TOKENS[-1]
    slope = (cpu[last] - cpu[first]) / max(tokens[last] - tokens[first], 1e-9)
    return {"per_request_s": cpu, "tokens": tokens, "per_token_s": slope, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench router_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smg", help="SGLang's router command (its own virtualenv's bin/smg)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    kinds = ["kvmesh_router"] + (["smg_cache_aware"] if args.smg else [])
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        engines = start_engines(1, Path(tmp), max_num_seqs=8)
        try:
            for kind in kinds:
                out[kind] = measure(kind, args, engines)
                print(f"{kind}: done", file=sys.stderr, flush=True)
        finally:
            for child, _ in engines:
                child.stop()
    header = ["router", *(f"CPU ms/request, {n} tokens" for n in MAX_TOKENS), "CPU ms per streamed token"]
    rows = [[k, *(1000 * r["per_request_s"][n] for n in MAX_TOKENS), 1000 * r["per_token_s"]] for k, r in out.items()]
    print(
        f"\none kvmesh engine ({MODEL}), {args.requests} sequential streamed chat requests, medians of {args.repeats}"
    )
    print_table(header, rows)
    write_json("router_overhead", {"args": {k: str(v) for k, v in vars(args).items()}, "routers": out}, args.json)


if __name__ == "__main__":
    main()
