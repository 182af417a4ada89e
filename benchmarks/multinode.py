"""Many nodes: time to ready on a cold and on a warm node, and failover under steady load.

Two Ray nodes on this machine, each in a network namespace with its own address and HOME
(``benchmarks/harness/netns_cluster.py``), Ray's token authentication on, ``kvmesh serve --address auto`` on
its defaults otherwise.

- **start**: both engine replicas on the worker. First with the worker's HOME empty (a new machine: the
  GGUF dequantized into its cache, the C++ kernels compiled for its CPU), then again (warm). The per-node
  preparation ``kvmesh serve`` prints is parsed into the table.
- **failover**: one engine replica on each node, an open-loop stream of requests from the head (prompts
  on a few shared prefixes, so the prefix cache matters). The worker is killed (every process of its
  namespace, SIGKILL) at ``--kill-at`` and started again at ``--rejoin-at``. Reported: requests failed and
  how (mid-stream on the lost node, or refused), time from the kill until every new request succeeds,
  time until the lost replica's index entries are gone, and the cache hit rate before the kill, while the
  node is away and after it returns.

    kvmesh bench multinode [--model smollm2-135m] [--rate 2] [--kill-at 20] [--rejoin-at 40]
        [--duration 90]

Writes ``benchmarks/results/multinode.json``. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvmesh.bench.harness.netns_cluster import WORKER_RESOURCE, NetnsCluster
from kvmesh.bench.harness.report import print_table, write_json

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
URL = "http://127.0.0.1:8000"
ENGINE = "engine: {torch_threads: 1, max_num_seqs: 16, num_kv_blocks: 2048}\n"
PREFIXES = 6


def serve(cluster: NetnsCluster, model: str, config: Path, log: Path, timeout_s: float = 900):
    """``kvmesh serve`` in the head's namespace; returns (process, seconds to ready as it printed them)."""
    proc = cluster.popen("head", [KVMESH, "serve", "--address", "auto", "--model", model, "--config", str(config)], log)
    deadline = time.monotonic() + timeout_s
    while (match := re.search(r"kvmesh is ready in ([\d.]+) s", log.read_text(errors="replace"))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvmesh serve did not start:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    return proc, float(match.group(1))


def stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    proc.wait(180)


def preparation(log: Path) -> dict:
    """The worker's preparation line: ``node X ready (N cores): model A s, CPU kernels B s``."""
    text = log.read_text(errors="replace")
    match = re.search(r"node \S+ ready \((\d+) cores\): model ([\d.]+) s(?:, CPU kernels ([\d.]+) s)?", text)
    if match is None:
        return {}
    return {"model_s": float(match.group(2)), "kernels_s": float(match.group(3) or 0)}


def bench_start(cluster: NetnsCluster, model: str, tmp: Path) -> list[dict]:
    config = tmp / "start.yaml"
    config.write_text(
        f"replicas: 2\nengine_actor_options: {{num_cpus: 0, resources: {{{WORKER_RESOURCE}: 1}}}}\n{ENGINE}"
    )
    rows = []
    for label in ("cold", "warm"):
        log = tmp / f"start-{label}.log"
        proc, ready_s = serve(cluster, model, config, log)
        stop(proc)
        rows.append({"node": label, "ready_s": ready_s, **preparation(log)})
    return rows


# ---------------------------------------------------------------------- the load, run inside the head's namespace
async def _one(client, model: str, prompt: str, results: list) -> None:
    import httpx

    row = {"sent": time.time(), "ok": False}
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    try:
        async with client.stream("POST", URL + "/v1/completions", json=body, timeout=120) as resp:
            if resp.status_code != 200:
                row["error"] = f"{resp.status_code} {json.loads(await resp.aread())['error'].get('code')}"
            else:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            row["error"] = f"stream {event['error'].get('code')}"
                        elif event.get("usage"):
                            row["ok"] = True
                            row["cached"] = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                            row["prompt"] = event["usage"]["prompt_tokens"]
    except httpx.HTTPError as exc:
        row["error"] = f"client {type(exc).__name__}"
    row["done"] = time.time()
    results.append(row)


async def _load(model: str, rate: float, duration: float, out: Path) -> None:
    import httpx

    results: list[dict] = []
    prefixes = [" ".join(f"topic{p} fact{i}" for i in range(160)) for p in range(PREFIXES)]
    async with httpx.AsyncClient() as client:
        tasks, start, i = [], time.monotonic(), 0
        while time.monotonic() - start < duration:
            prompt = f"{prefixes[i % PREFIXES]} question {i}"
            tasks.append(asyncio.create_task(_one(client, model, prompt, results)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        await asyncio.gather(*tasks)
    out.write_text(json.dumps(results))


def _watch(seconds: float, out: Path) -> None:
    """Poll ``/status`` every 0.1 s: which replicas report, and the index's size."""
    import urllib.request

    rows, end = [], time.time() + seconds
    while time.time() < end:
        try:
            with urllib.request.urlopen(URL + "/status", timeout=2) as resp:
                status = json.loads(resp.read())
            rows.append(
                {"t": time.time(), "replicas": sorted(status["replicas"]), "entries": status["index"]["entries"]}
            )
        except OSError:
            pass
        time.sleep(0.1)
    out.write_text(json.dumps(rows))


# ---------------------------------------------------------------------- failover
def hit_rate(rows: list[dict], start: float, end: float) -> float | None:
    done = [r for r in rows if r["ok"] and start <= r["sent"] < end]
    return sum(r["cached"] for r in done) / sum(r["prompt"] for r in done) if done else None


def bench_failover(cluster: NetnsCluster, model: str, tmp: Path, args) -> dict:
    config = tmp / "failover.yaml"
    config.write_text(f"replicas: 2\nengine_actor_options: {{num_cpus: 0, resources: {{kvmesh_engine: 1}}}}\n{ENGINE}")
    proc, _ = serve(cluster, model, config, tmp / "failover.log")
    try:
        me = [KVMESH, "bench", "multinode"]
        load_out, watch_out = tmp / "load.json", tmp / "watch.json"
        load = cluster.popen(
            "head", [*me, "_load", model, str(args.rate), str(args.duration), str(load_out)], tmp / "load.log"
        )
        watch = cluster.popen("head", [*me, "_watch", str(args.duration + 30), str(watch_out)], tmp / "watch.log")
        t0 = time.time()
        time.sleep(max(0.0, t0 + args.kill_at - time.time()))
        before = json.loads(cluster.run("head", [KVMESH, "status", "--json"]).stdout)
        lost = [rid for rid, r in before["replicas"].items() if r["node"] == cluster.ips["worker"]]
        killed = time.time()
        cluster.kill_node("worker")
        time.sleep(max(0.0, t0 + args.rejoin_at - time.time()))
        rejoined = time.time()
        cluster.start_worker(resources={"kvmesh_engine": 1})
        load.wait(args.duration + 300)
        watch.wait(args.duration + 300)
    finally:
        stop(proc)
    rows, seen = json.loads(load_out.read_text()), json.loads(watch_out.read_text())
    failed = [r for r in rows if not r["ok"]]
    after_kill = [r for r in failed if r["sent"] >= killed]
    back = next((s["t"] for s in seen if s["t"] > rejoined and len(s["replicas"]) == 2), None)
    clean = next((s["t"] for s in seen if s["t"] > killed and not set(lost) & set(s["replicas"])), None)
    return {
        "requests": len(rows),
        "failed": len(failed),
        "failed_by_kind": {k: sum(1 for r in failed if r["error"] == k) for k in {r["error"] for r in failed}},
        "failed_sent_after_kill": len(after_kill),
        "last_failure_after_kill_s": max((r["sent"] - killed for r in after_kill), default=None),
        "index_clean_after_kill_s": clean - killed if clean else None,
        "replica_back_after_rejoin_s": back - rejoined if back else None,
        "hit_rate_before": hit_rate(rows, t0 + 5, killed),
        "hit_rate_node_away": hit_rate(rows, killed, back or rejoined),
        "hit_rate_after_return": hit_rate(rows, back or rejoined, t0 + args.duration),
        "e2e_median_s_before": statistics.median(r["done"] - r["sent"] for r in rows if r["ok"] and r["sent"] < killed),
        "kill_at_s": killed - t0,
        "rejoin_at_s": rejoined - t0,
    }


def main(argv: list[str] | None = None) -> None:
    helper = sys.argv[1:] if argv is None else argv  # the load and the watcher run as this benchmark, in the head
    if helper[:1] == ["_load"]:
        asyncio.run(_load(helper[1], float(helper[2]), float(helper[3]), Path(helper[4])))
        return
    if helper[:1] == ["_watch"]:
        _watch(float(helper[1]), Path(helper[2]))
        return
    ap = argparse.ArgumentParser(
        prog="kvmesh bench multinode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, open loop")
    ap.add_argument("--kill-at", type=float, default=20.0)
    ap.add_argument("--rejoin-at", type=float, default=40.0)
    ap.add_argument("--duration", type=float, default=90.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmesh-multinode-") as tmp:
        cluster = NetnsCluster(Path(tmp), auth_token=secrets.token_hex(16))
        try:
            cluster.create()
            cluster.start_head(resources={"kvmesh_engine": 1})
            cluster.start_worker(resources={"kvmesh_engine": 1})
            start = bench_start(cluster, args.model, Path(tmp))
            failover = bench_failover(cluster, args.model, Path(tmp), args)
        finally:
            cluster.teardown()
    print_table(
        ["worker node", "ready s", "model prep s", "CPU kernels s"],
        [[r["node"], r["ready_s"], r.get("model_s"), r.get("kernels_s")] for r in start],
    )
    print_table(["failover", "value"], [[k, v] for k, v in failover.items()])
    write_json("multinode", {"model": args.model, "args": vars(args), "start": start, "failover": failover})


if __name__ == "__main__":
    main()
