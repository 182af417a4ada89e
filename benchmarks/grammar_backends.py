"""Structured-output libraries side by side on SmolLM2's tokenizer: xgrammar (what kvmesh uses),
llguidance and outlines-core, each installed separately (benchmark tools, not dependencies).

For each JSON schema: the compile time (cold, median of ``--repeats``), and the per-token cost of decoding
under it: a valid answer (``json.dumps``'s separators, which every library is set to require) is tokenized
and walked token by token, each step computing the next-token mask and accepting the token (medians over
repeats, microseconds per token). A library that is not installed, or
cannot build its index here, is reported as such.

    pip install llguidance outlines-core   # into any environment with kvmesh's
    kvmesh bench grammar_backends [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.core.model_files import load_tokenizer, resolve_model_dir

SCHEMAS = {
    "tool call (object, enum, integer)": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
        {"city": "Oslo", "unit": "celsius", "days": 3},
    ),
    "record (nested array of objects)": (
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"name": {"type": "string"}, "price": {"type": "number"}},
                        "required": ["name", "price"],
                    },
                },
            },
            "required": ["title", "tags", "items"],
        },
        {
            "title": "Weekly order",
            "tags": ["food", "home"],
            "items": [{"name": "bread", "price": 2.5}, {"name": "soap", "price": 1.25}],
        },
    ),
}


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def xgrammar_backend(tokenizer, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)

    def compile_(schema: str):
        return xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema, any_whitespace=False)

    def walk(compiled, tokens: list[int]) -> None:
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for t in tokens:
            matcher.fill_next_token_bitmask(mask)
            assert matcher.accept_token(t), "xgrammar refused a token of the valid answer"

    return compile_, walk


def llguidance_backend(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, vocab)

    def compile_(schema: str):
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as xgrammar's
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact)
        matcher = llguidance.LLMatcher(lltok, grammar)  # builds its parser: the compile step's counterpart
        if matcher.get_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def walk(grammar, tokens: list[int]) -> None:
        matcher = llguidance.LLMatcher(lltok, grammar)
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        for t in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(t), f"llguidance refused a token: {matcher.get_error()}"

    return compile_, walk


def outlines_core_backend(tokenizer, vocab: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    decoder = tokenizer.backend_tokenizer.decoder
    by_text: dict[str, list[int]] = {}
    eos = tokenizer.eos_token_id
    for token, i in tokenizer.get_vocab().items():
        if i != eos and i < vocab:
            by_text.setdefault(decoder.decode([token]), []).append(i)
    vocabulary = Vocabulary(eos, by_text)

    def compile_(schema: str):
        return Index(build_regex_from_schema(schema), vocabulary)

    def walk(index, tokens: list[int]) -> None:
        guide = Guide(index)
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        for t in tokens:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            guide.advance(t)

    return compile_, walk


def measure(compile_, walk, schema: str, tokens: list[int], repeats: int) -> tuple[float, float]:
    """Median seconds to compile ``schema`` cold, and to walk ``tokens`` under it."""
    compiles = [timed(lambda: compile_(schema)) for _ in range(repeats)]
    compiled = compiles[-1][1]
    walks = [timed(lambda: walk(compiled, tokens))[0] for _ in range(repeats)]
    return median([c[0] for c in compiles]), median(walks)


BACKENDS = {"xgrammar": xgrammar_backend, "llguidance": llguidance_backend, "outlines-core": outlines_core_backend}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench grammar_backends", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="grammar_backends")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = resolve_model_dir("smollm2-135m", weights=False)
    tokenizer = load_tokenizer(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    results: dict[str, dict] = {}
    rows = []
    for name, make in BACKENDS.items():
        try:
            compile_, walk = make(tokenizer, vocab)
        except Exception as exc:  # not installed, or its tokenizer support does not take this one
            results[name] = {"unavailable": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append([name, "-", "-", "-", f"unavailable ({type(exc).__name__})"])
            continue
        results[name] = {}
        for label, (schema, answer) in SCHEMAS.items():
            text = json.dumps(schema)
            tokens = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
            try:
                compile_s, walk_s = measure(compile_, walk, text, tokens, args.repeats)
            except Exception as exc:
                results[name][label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append([name, label, "-", "-", f"error ({type(exc).__name__})"])
                continue
            compile_ms = 1000 * compile_s
            per_token_us = 1e6 * walk_s / len(tokens)
            results[name][label] = {"compile_ms": compile_ms, "per_token_us": per_token_us, "tokens": len(tokens)}
            rows.append([name, label, compile_ms, per_token_us, ""])
    print_table(["library", "schema", "compile ms (cold)", "mask + accept us/token", "note"], rows)
    write_json(args.json, {"tokenizer": "SmolLM2-135M (49,152)", "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
