"""The ``kvmesh`` command: ``serve`` a cluster, show its ``status``, ``generate`` from one local engine, or
``plan`` a GPU pool by KV memory."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from kvmesh.core.defaults import ROUTER_LOAD_PERIOD_S
from kvmesh.core.engine_config import GPU_KV_FRACTION, PREEMPTION_MODES, EngineConfig
from kvmesh.core.kv_dtype import KV_CACHE_DTYPES, MODEL_DTYPE_BYTES
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.model_files import DEFAULT_MODEL


def _generate(args: argparse.Namespace) -> int:
    from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(  # validated before the (slow) model load
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop
    )
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    config = EngineConfig(
        model=args.model, device=args.device, torch_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype
    )
    engine = LLMEngine(config)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    prompt = args.prompt
    ids = engine.apply_chat_template([{"role": "user", "content": prompt}]) if not args.raw else engine.tokenize(prompt)
    try:
        engine.add_request(ids, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    first = None
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            first = first or time.perf_counter()
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            final = out
    end = time.perf_counter()
    n = len(final.token_ids)
    decode = n / (end - first) if n > 1 and end > first else 0.0
    print(
        f"\n[{n} tokens, finish={final.finish_reason}, TTFT {1000 * (first - start):.0f} ms, {decode:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


def _engine_settings(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields the engine flags set (``kvmesh serve`` and ``kvmesh engine`` share them)."""
    engine = {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_bytes": int(args.kv_cache_gib * (1 << 30)) if args.kv_cache_gib else None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "swap_space_bytes": int(args.swap_space_gib * (1 << 30)) if args.swap_space_gib is not None else None,
        "host_cache_bytes": int(args.host_cache_gib * (1 << 30)) if args.host_cache_gib is not None else None,
        "disk_cache_dir": args.disk_cache_dir,
        "disk_cache_bytes": int(args.disk_cache_gib * (1 << 30)) if args.disk_cache_gib is not None else None,
        "preemption_mode": args.preemption_mode,
        "device": args.device,
        "torch_threads": args.threads,
        "enforce_eager": args.enforce_eager,
        "simulate": args.simulate,
    }
    return {k: v for k, v in engine.items() if v is not None}


def _kv_events(args: argparse.Namespace) -> KVEventsConfig | None:
    """``--kv-events-config``, checked now: a typo fails before any model loads."""
    return None if args.kv_events_config is None else KVEventsConfig.parse(args.kv_events_config)


POLICY_KWARGS_HELP = "the policy's settings as JSON, e.g. '{\"session_balance\": 1.5}' (docs/routing.md)"


def _policy_kwargs(args: argparse.Namespace) -> dict | None:
    """``--policy-kwargs`` as its JSON mapping (the policy checks the settings themselves)."""
    if args.policy_kwargs is None:
        return None
    try:
        kwargs = json.loads(args.policy_kwargs)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--policy-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--policy-kwargs must be a JSON object, got {args.policy_kwargs!r}")
    return kwargs


def _engine(args: argparse.Namespace) -> int:
    from kvmesh.cluster.engines.engine_server import run_engine_server

    settings = _engine_settings(args) | _lora_settings(args)
    return run_engine_server(args, EngineConfig(model=args.model, **settings), _kv_events(args))


def _lora_settings(args: argparse.Namespace) -> dict:
    """The LoRA flags as ``EngineConfig`` fields (vLLM's flags and meanings); adapter paths made absolute, as
    every process of a cluster reads them from its own working directory."""
    modules = {}
    for item in args.lora_modules or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        modules[name] = str(Path(path).resolve())
    enable = args.enable_lora or bool(modules) or bool(args.lora_root)
    lora = {"enable_lora": enable or None, "lora_modules": modules or None}
    lora |= {"max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras, "max_loras": args.max_loras}
    return {k: v for k, v in lora.items() if v is not None}


def _router(args: argparse.Namespace) -> int:
    from kvmesh.cluster.workers.router_server import run_router_server

    return run_router_server(args, _policy_kwargs(args))


def _serve(args: argparse.Namespace) -> int:
    from kvmesh.cluster.launch.config import build_config
    from kvmesh.cluster.launch.launcher import run_until_signalled
    from kvmesh.cluster.workers.worker_spec import WorkerSpec

    autoscaling = {"upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": args.downscale_delay_s}
    overrides = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "replicas": 0 if args.worker and args.replicas is None else args.replicas,
        "workers": [WorkerSpec.parse(w) for w in args.worker] if args.worker else None,
        "ingress_replicas": args.ingress_replicas,
        "policy": args.policy,
        "policy_kwargs": _policy_kwargs(args),
        "address": args.address,
        "redis_url": args.redis_url,
        "host": args.host,
        "http_port": args.port,
        "grpc_port": args.grpc_port,
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": args.max_queued_requests,
        "max_inflight_requests": args.max_inflight_requests,
        "max_request_bytes": args.max_request_bytes,
        "api_keys": args.api_key or None,
        "share_prefix_cache": args.share_prefix_cache,
        "enable_docs": args.enable_docs,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "scaling_policy": args.scaling_policy,
        "target_kv_util": args.target_kv_util,
        "drain_timeout_s": args.drain_timeout_s,
        "prefill_replicas": args.prefill_replicas,
        "keep_kv": args.keep_kv,
        "no_replica_timeout_s": args.no_replica_timeout_s,
        "kv_events_config": _kv_events(args),
        "engine": _engine_settings(args) | _lora_settings(args),
        "lora_roots": args.lora_root,
        "autoscaling": {k: v for k, v in autoscaling.items() if v is not None},
    }
    return run_until_signalled(build_config(args.config, overrides))


def _status(args: argparse.Namespace) -> int:
    from kvmesh.cluster.monitoring.status import fetch_status, render_status

    try:
        status = fetch_status(args.url, api_key=args.api_key or os.environ.get("KVMESH_API_KEY"))
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status.as_dict(), indent=2) if args.json else render_status(status))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kvmesh.cluster.launch.plan import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    from kvmesh.bench import command

    command(args.bench).main(args.rest)
    return 0


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, for ``kvmesh serve`` (each replica) and ``kvmesh engine``."""
    parser.add_argument("--block-size", type=int, help="KV block size in tokens (default 16)")
    parser.add_argument("--max-num-seqs", type=int, help="running batch size per replica (default 64)")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--num-kv-blocks", type=int, help="exact KV pool size per replica, in blocks")
    parser.add_argument("--kv-cache-gib", type=float, help="KV pool per replica in GiB (CPU default 1)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="KV storage: auto (model dtype, default), fp8_e4m3, fp8_e5m2, int8, int4 (3.5-3.8x a 16-bit cache)",
    )
    parser.add_argument(
        "--swap-space-gib",
        type=float,
        help="host memory per replica for swapped-out sequences (default: half the KV pool, <= 4; 0: off)",
    )
    parser.add_argument(
        "--host-cache-gib",
        type=float,
        help="host memory per replica keeping prefix blocks evicted from the KV pool (default: 2x the pool, "
        "<= 16, on CUDA; off on the CPU unless there is a disk tier; 0: off)",
    )
    parser.add_argument(
        "--disk-cache-dir",
        help="directory of the disk tier: blocks the host tier evicts are kept in files and adopted by a replica "
        "restarted on it (replicas sharing it each take a slot of their own)",
    )
    parser.add_argument("--disk-cache-gib", type=float, help="size of the disk tier per replica (default 16)")
    parser.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        help="preempted sequences: auto (swap when cheaper than recompute, default), swap, recompute",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="run every engine step eagerly: no CUDA graphs of decode steps (CUDA only)",
    )
    parser.add_argument("--threads", type=int, help="torch threads per replica (default: cores / replicas)")
    parser.add_argument(
        "--simulate",
        nargs="?",
        const="default",
        metavar="TIMING",
        help="run no model: each step sleeps as a timing model says and yields deterministic tokens (default: a "
        "GPU-class replica; a `kvmesh bench calibrate` JSON as PATH[:SPEEDUP]; or "
        "prefill_tok_s=..,decode_s_per_seq=..,min_step_s=..) (docs/simulated_engine.md)",
    )
    parser.add_argument(
        "--kv-events-config",
        help='publish KV events as vLLM does, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (vLLM\'s keys; docs/kv_events.md)',
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvmesh`` command line: one subcommand per ``_add_*_command``."""
    parser = argparse.ArgumentParser(prog="kvmesh", description="Multi-replica LLM serving with KV-aware routing")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_generate_command,
        _add_serve_command,
        _add_engine_command,
        _add_router_command,
        _add_bench_command,
        _add_plan_command,
        _add_status_command,
    ):
        add(sub)
    return parser


def _add_generate_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh generate``: one completion from a local engine."""
    gen = sub.add_parser("generate", help="stream a completion from a local engine (no cluster)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF model directory, .gguf file or hub id")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    gen.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV storage (default auto)")
    gen.set_defaults(func=_generate)


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh serve``: the cluster's settings, over its config file's."""
    srv = sub.add_parser(
        "serve",
        help="start a cluster: Ray, Redis, OpenAI HTTP on :8000, gRPC on :9000, N engine replicas",
        description="Flags override the --config YAML file, which overrides the defaults (cluster/launch/config.py).",
    )
    srv.add_argument("--config", help="YAML file of ClusterConfig settings (engine settings under `engine:`)")
    srv.add_argument("--model", help=f"alias, HF model directory, .gguf file or hub id (default {DEFAULT_MODEL})")
    srv.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    srv.add_argument(
        "--replicas", type=int, help="kvmesh engine replicas (default 2; 0 with --worker, or N beside the workers)"
    )
    srv.add_argument(
        "--worker",
        action="append",
        help="route an external OpenAI-compatible engine (vLLM, SGLang, kvmesh engine), repeatable: "
        "URL[,kv_events=tcp://HOST:5557][,replay=tcp://HOST:5558][,topic=T][,model=NAME]",
    )
    _add_autoscaling_args(srv)
    srv.add_argument("--ingress-replicas", type=int, help="ingress replicas, each with its own router (default 1)")
    srv.add_argument("--policy", help="kv_aware (default), pow2, round_robin, session_hash, approx_tree")
    srv.add_argument("--policy-kwargs", help=POLICY_KWARGS_HELP)
    srv.add_argument(
        "--address",
        help="join this Ray cluster instead of starting one (auto or host:port); docs/multinode.md",
    )
    srv.add_argument(
        "--redis-url",
        help="index Redis (default: $KVMESH_REDIS_URL, else an embedded one on loopback with a random password)",
    )
    srv.add_argument("--host", help="HTTP and gRPC bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, help="HTTP port (default 8000)")
    srv.add_argument("--grpc-port", type=int, help="gRPC port on --host (default 9000; 0: no gRPC)")
    _add_admission_args(srv)
    _add_engine_args(srv)
    _add_lora_args(srv)
    srv.set_defaults(func=_serve)


def _add_autoscaling_args(srv: argparse.ArgumentParser) -> None:
    """``kvmesh serve``'s replica bounds, scaling signal and delays, and how removed or missing replicas are met."""
    srv.add_argument("--min-replicas", type=int, help="autoscaling: fewest engine replicas (default 1)")
    srv.add_argument("--max-replicas", type=int, help="autoscaling: most engine replicas (default: no autoscaling)")
    srv.add_argument("--target-kv-util", type=float, help="autoscaling: KV demand per replica to aim for (0.7)")
    srv.add_argument("--scaling-policy", help="autoscaling signal: kv_pressure (default) or ongoing_requests (Ray's)")
    srv.add_argument("--upscale-delay-s", type=float, help="autoscaling: pressure must last this long (default 5)")
    srv.add_argument("--downscale-delay-s", type=float, help="autoscaling: low demand must last this long (60)")
    srv.add_argument("--drain-timeout-s", type=float, help="a removed replica's time to finish its streams (60)")
    srv.add_argument(
        "--prefill-replicas",
        type=int,
        help="engine replicas that only prefill long prompts other replicas fetch and decode (default 0)",
    )
    srv.add_argument(
        "--no-keep-kv",
        dest="keep_kv",
        action="store_false",
        default=None,
        help="start replicas cold and drop a removed replica's cache (default: warm start and hand-off)",
    )
    srv.add_argument(
        "--no-replica-timeout-s",
        type=float,
        help="a request's wait while no engine replica lives, then 503 (5)",
    )


def _add_admission_args(srv: argparse.ArgumentParser) -> None:
    """``kvmesh serve``'s admission: queue and in-flight bounds, request size, API keys, cache sharing, docs."""
    srv.add_argument("--max-ongoing-requests", type=int, help="requests one replica takes at once (default 64)")
    srv.add_argument(
        "--max-queued-requests",
        type=int,
        help="requests a router holds for busy replicas; more get 503 (default 256, -1 unbounded)",
    )
    srv.add_argument(
        "--max-inflight-requests",
        type=int,
        help="generations one ingress replica runs at once; more get 429 (default 1024, 0 unbounded)",
    )
    srv.add_argument(
        "--max-request-bytes",
        type=int,
        help="largest request body, HTTP and gRPC (default: what the longest prompt that fits takes)",
    )
    srv.add_argument(
        "--api-key",
        action="append",
        help="require this Bearer key (repeatable; also $KVMESH_API_KEYS, comma-separated)",
    )
    srv.add_argument(
        "--share-prefix-cache",
        action="store_true",
        default=None,
        help="let requests of different API keys share cached prefixes (default: one cache per key)",
    )
    srv.add_argument(
        "--enable-docs",
        action="store_true",
        default=None,
        help="serve the API's /docs, /redoc and /openapi.json (default: off)",
    )


def _add_engine_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh engine``: one engine as an OpenAI-compatible server."""
    eng = sub.add_parser(
        "engine",
        help="one engine as an OpenAI-compatible server (no Ray, no Redis), for any router: like `vllm serve`",
    )
    eng.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF model directory, .gguf file or hub id")
    eng.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    eng.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    eng.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    eng.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    eng.add_argument("--max-inflight-requests", type=int, default=1024, help="more get 429 (default 1024, 0: no bound)")
    eng.add_argument(
        "--kv-transfer-port",
        type=int,
        default=0,
        help="where peers fetch this engine's KV blocks, on --host (default 0: any free port; GET /load names it)",
    )
    eng.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines in this process, on --port, --port+1, ... (KV event ports offset alike); with --simulate only",
    )
    _add_engine_args(eng)
    _add_lora_args(eng)
    eng.set_defaults(func=_engine)


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters beside the model, as ``vllm serve`` takes them."""
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by the flags below)")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", help="PEFT adapters to load at start")
    parser.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, help="adapters kept in memory (default 8)")
    parser.add_argument("--max-loras", type=int, help="most adapters one step runs (default: no cap)")
    parser.add_argument(
        "--lora-root",
        action="append",
        help="a directory POST /v1/load_lora_adapter may load from (repeatable; without it the endpoint loads nothing)",
    )


def _add_router_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh router``: the KV-aware router in one process, before external workers."""
    rtr = sub.add_parser(
        "router",
        help="kvmesh's KV-aware router in one process (no Ray, no Redis) in front of external workers: like smg",
        description="Follows each worker's vLLM-style KV events itself; docs/kv_events.md.",
    )
    rtr.add_argument(
        "--worker",
        action="append",
        required=True,
        help="an OpenAI-compatible engine, repeatable: URL[,kv_events=tcp://HOST:5557][,replay=tcp://HOST:5558]"
        "[,topic=T][,model=NAME]",
    )
    rtr.add_argument("--model", default=DEFAULT_MODEL, help="the workers' model: its tokenizer and chat template")
    rtr.add_argument("--served-model-name", help="the name clients send as `model` (default: --model)")
    rtr.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    rtr.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    rtr.add_argument("--policy", default="kv_aware", help="kv_aware (default), round_robin, session_hash, ...")
    rtr.add_argument("--policy-kwargs", help=POLICY_KWARGS_HELP)
    rtr.add_argument("--block-size", type=int, default=16, help="the index's block size in tokens (default 16)")
    rtr.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    rtr.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    rtr.add_argument("--max-inflight-requests", type=int, default=1024, help="more get 429 (default 1024)")
    rtr.add_argument(
        "--redis-url",
        help="share what this router sends with the other kvmesh router processes in front of the same workers "
        "(each counts the others' requests and recent prefixes at once, not one load report late); default: none",
    )
    rtr.add_argument(
        "--load-period-s",
        type=float,
        default=ROUTER_LOAD_PERIOD_S,
        help=f"read a worker's load (GET /load) once no report came for this long (default {ROUTER_LOAD_PERIOD_S}; "
        "a kvmesh engine sends one with each response): what other routers sent there is seen this late",
    )
    rtr.set_defaults(func=_router)


def _add_bench_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh bench NAME ...``: hands the rest to benchmark NAME (the module benchmarks/NAME.py)."""
    from kvmesh.bench import commands

    bench = sub.add_parser(
        "bench",
        help="benchmarks: run (routers side by side on a real cluster), simulate (fleet-scale trace), suite, ...",
        description="kvmesh bench NAME runs benchmarks/NAME.py; kvmesh bench NAME --help shows its options.",
    )
    bench.add_argument("bench", choices=commands(), metavar="NAME", help=", ".join(commands()))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    bench.set_defaults(func=_bench)


def _add_plan_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh plan``: sizing a GPU pool's KV cache."""
    plan = sub.add_parser(
        "plan",
        help="size a GPU pool: KV bytes per token, blocks, sequences and replicas for each KV cache dtype",
        description="Reads the model's config only (no weights). Sizes: 80GiB, 24GB (10^9), 512Mi, or bytes.",
    )
    plan.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF model directory, config.json, .gguf or hub id")
    budget = plan.add_mutually_exclusive_group(required=True)
    budget.add_argument("--device-memory", help="memory of the GPU each replica runs on, e.g. 80GiB")
    budget.add_argument("--kv-memory", help="the KV budget of one replica, e.g. 40GiB")
    plan.add_argument(
        "--memory-fraction",
        type=float,
        help=f"share of the memory the weights leave that goes to KV (default {GPU_KV_FRACTION}, the engine's on GPU)",
    )
    work = plan.add_mutually_exclusive_group(required=True)
    work.add_argument("--context-len", type=int, help="tokens per sequence, prompt + output")
    work.add_argument(
        "--lengths",
        help="file of sequence lengths: one per line, or JSONL with input_length and output_length (Mooncake traces)",
    )
    plan.add_argument("--percentile", type=float, help="size for this percentile of --lengths (default: the mean)")
    plan.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"KV block size in tokens (default {EngineConfig.block_size})",
    )
    plan.add_argument(
        "--dtype",
        help=f"model dtype for the `auto` KV dtype: {', '.join(MODEL_DTYPE_BYTES)} "
        "(default: the config's, else bfloat16)",
    )
    plan.add_argument("--target-concurrency", type=int, help="concurrent sequences the pool must hold")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_plan)


def _add_status_command(sub: argparse._SubParsersAction) -> None:
    """``kvmesh status``: a running cluster's state."""
    st = sub.add_parser("status", help="replicas, routing decisions, index and Redis of a running cluster")
    st.add_argument("--url", default="http://127.0.0.1:8000", help="the cluster's HTTP address")
    st.add_argument("--json", action="store_true", help="print the raw status document")
    st.add_argument("--api-key", help="the cluster's API key, if it requires one (default: $KVMESH_API_KEY)")
    st.set_defaults(func=_status)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
