"""The ``kvmesh`` command. ``kvmesh generate`` streams a completion from one local engine."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from replica.model_loader import DEFAULT_MODEL


def _generate(args: argparse.Namespace) -> int:
    from replica import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(  # validated before the (slow) model load
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop=args.stop
    )
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, torch_threads=args.threads))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="Multi-replica LLM serving with KV-aware routing")
    sub = parser.add_subparsers(dest="command", required=True)
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
    gen.set_defaults(func=_generate)
    return parser


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
