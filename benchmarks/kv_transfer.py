"""Moving a prefix's KV from one replica to another, against recomputing it and against the raw path.

    kvmesh bench kv_transfer [--prefix-tokens 8000] [--pairs 3] [--netns] [--holder-streams N] [--json OUT.json]

A holder (``kvmesh engine``, SmolLM2, one torch thread) computes a fresh prefix of ``--prefix-tokens`` token
ids per pair; a receiver (an engine in a process of its own, one torch thread) then, in an order that
rotates from pair to pair: pulls it from the holder and answers the prompt (``fetch``: the move, then the
first token on the fetched prefix), recomputes it (``recompute``: the first token on a cold cache) and reads
the same number of bytes from the holder over the same connection code without any KV work (``path``:
``KVPeer.probe``, zero blocks, framed and checksummed). Per pair: the transfer's rate over the path's, and the
move's time (and the fetched TTFT) over the recompute's TTFT. With ``--netns`` the holder runs in a network
namespace of its own and the receiver in another, joined by a veth pair (root). With ``--holder-streams N`` the
holder decodes N long streams all the while (a conversation's busy home: its blocks are exported between
the steps of a full batch). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvmesh.bench.harness.peer_fleet import Child
from kvmesh.bench.harness.report import print_table, spread, write_json
from kvmesh.cluster.launch.embedded_redis import free_port

MODEL = "smollm2-135m"
BLOCK = 16
TASKS = ("fetch", "recompute", "path")
STREAM_TOKENS = 4000
"""Output tokens of each of the holder's ``--holder-streams`` generations (cancelled at the end of a pair)."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh bench kv_transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=8000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--netns", action="store_true", help="holder and receiver in two network namespaces (root)")
    ap.add_argument("--holder-streams", type=int, default=0, help="long generations the holder decodes meanwhile")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--receive-from", help=argparse.SUPPRESS)  # the receiver's role, in its own process
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.receive_from:
        print(json.dumps(asyncio.run(receive(args.receive_from, args.prefix_tokens, args.pairs, args.holder_streams))))
        return
    rows = run(args)
    report(args, rows)


def run(args: argparse.Namespace) -> list[dict]:
    """Start the holder (in its namespace with ``--netns``), run the receiver's pairs, stop everything."""
    blocks = -(-args.prefix_tokens // BLOCK) + 64
    blocks += args.holder_streams * -(-(32 + STREAM_TOKENS) // BLOCK)  # its streams never evict the prefix
    receiver = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "bench", "kv_transfer"]
    receiver += ["--prefix-tokens", str(args.prefix_tokens), "--pairs", str(args.pairs)]
    receiver += ["--holder-streams", str(args.holder_streams)]
    netns = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.netns:
                from kvmesh.bench.harness.netns_cluster import NetnsCluster

                netns = NetnsCluster(Path(tmp)).create()
            host = netns.ips["worker"] if netns else "127.0.0.1"
            port = free_port()
            cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", MODEL, "--host", host]
            cmd += ["--port", str(port), "--threads", "1", "--num-kv-blocks", str(blocks)]
            holder = Child("kv-holder", netns.command("worker", cmd) if netns else cmd, f"http://{host}:{port}", "")
            try:
                _wait(holder, netns)
                receiver += ["--receive-from", holder.url]
                done = subprocess.run(
                    netns.command("head", receiver) if netns else receiver, capture_output=True, text=True, check=False
                )
                if done.returncode:
                    raise RuntimeError(f"the receiver failed: {done.stderr[-3000:]}")
                return json.loads(done.stdout.strip().splitlines()[-1])
            finally:
                holder.stop()
        finally:
            if netns is not None:
                netns.teardown()


def _wait(holder: Child, netns) -> None:
    """Until the holder answers ``/health`` (from the receiver's namespace with ``--netns``)."""
    if netns is None:
        holder.ready_path = "/health"
        holder.wait_ready()
        return
    probe = f"import httpx,sys; sys.exit(httpx.get('{holder.url}/health', timeout=2).status_code != 200)"
    deadline = time.monotonic() + 300
    while netns.python("head", probe, timeout=30).returncode:
        if holder.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the holder did not start: {holder.log.read_text()[-2000:]}")
        time.sleep(1)


async def receive(holder_url: str, prefix_tokens: int, pairs: int, holder_streams: int = 0) -> list[dict]:
    """The receiver's side: per pair a fresh prefix on the holder, then fetch, recompute and path in turn
    (the holder decoding ``holder_streams`` long generations meanwhile)."""
    from kvmesh.core.hashing import hash_blocks
    from kvmesh.core.messages import KVFetch
    from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
    from kvmesh.replica.async_llm import AsyncLLM
    from kvmesh.replica.kv_peer import KVPeer

    blocks = -(-prefix_tokens // BLOCK) + 64
    llm = AsyncLLM(LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=blocks, torch_threads=1)))
    peer = KVPeer(llm)
    params = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    async with httpx.AsyncClient(base_url=holder_url, timeout=600) as http:
        address = (await http.get("/load")).json()["kv_address"]
        for i in range(pairs):
            prompt = random.Random(i).choices(range(1000, 40000), k=prefix_tokens)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            (await http.post("/v1/completions", json=body)).raise_for_status()
            n = (prefix_tokens - 1) // BLOCK
            plan = KVFetch(holder="holder", address=address, num_blocks=n)
            hashes = hash_blocks(prompt, BLOCK, llm.engine.hash_seed)
            row = {"pair": i, "bytes": n * peer.block_bytes}
            streams = [asyncio.create_task(_decode(http, k)) for k in range(holder_streams)]
            await asyncio.sleep(2.0 if streams else 0.0)  # their prompts are in, they decode
            for task in TASKS[i % 3 :] + TASKS[: i % 3]:
                await llm.reset_prefix_cache()
                began = time.perf_counter()
                if task == "path":
                    row["path_bytes_s"] = await peer.probe(address, n)
                    continue
                if task == "fetch":
                    row["fetched_blocks"] = await peer.fetch(plan, hashes, token_ids=prompt, timeout_s=300)
                    row["move_s"] = time.perf_counter() - began
                async for out in llm.generate(prompt, params):
                    row[f"{task}_token"] = out.token_ids
                row[f"{task}_ttft_s"] = time.perf_counter() - began
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            row["fetch_bytes_s"] = row["bytes"] / row["move_s"]
            rows.append(row)
    await llm.shutdown()
    return rows


async def _decode(http: httpx.AsyncClient, k: int) -> None:
    """One long greedy generation streamed from the holder, read until cancelled."""
    prompt = random.Random(1000 + k).choices(range(1000, 40000), k=32)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        async for _ in reply.aiter_bytes():
            pass


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    for r in rows:
        r["rate_over_path"] = r["fetch_bytes_s"] / r["path_bytes_s"]
        r["move_over_recompute"] = r["move_s"] / r["recompute_ttft_s"]
        r["ttft_over_recompute"] = r["fetch_ttft_s"] / r["recompute_ttft_s"]
        r["same_token"] = r["fetch_token"] == r["recompute_token"]
    keys = ("rate_over_path", "move_over_recompute", "ttft_over_recompute")
    summary = {k: spread([r[k] for r in rows]) for k in keys}
    table = [
        [
            r["pair"],
            f"{r['bytes'] / 1e6:.0f}",
            f"{r['fetch_bytes_s'] / 1e9:.2f}",
            f"{r['path_bytes_s'] / 1e9:.2f}",
            f"{r['rate_over_path']:.2f}",
            f"{r['move_s']:.2f}",
            f"{r['recompute_ttft_s']:.2f}",
            f"{r['fetch_ttft_s']:.2f}",
            f"{r['move_over_recompute']:.3f}",
            r["same_token"],
        ]
        for r in rows
    ]
    headers = ["pair", "MB", "fetch GB/s", "path GB/s", "fetch/path", "move s", "recompute TTFT s"]
    print_table([*headers, "fetched TTFT s", "move/recompute", "same token"], table)
    for k in keys:
        s = summary[k]
        print(f"{k}: median {s['median']:.3f} over {len(rows)} pairs (range {s['min']:.3f}-{s['max']:.3f})")
    where = ("two network namespaces (veth)" if args.netns else "loopback") + (
        f", the holder decoding {args.holder_streams} streams" if args.holder_streams else ""
    )
    payload = {"path": where, "prefix_tokens": args.prefix_tokens, "rows": rows, "summary": summary}
    name = "kv_transfer" + ("_netns" if args.netns else "") + ("_busy" if args.holder_streams else "")
    write_json(name, {**payload, "holder_streams": args.holder_streams}, args.json)


if __name__ == "__main__":
    main()
