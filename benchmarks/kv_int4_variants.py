"""How to scale a 4-bit KV cache: the candidate layouts side by side on SmolLM2, before committing to one.

    kvmesh bench kv_int4_variants [--model smollm2-135m] [--ppl-chunks 8]

Each candidate is simulated in the engine's own torch attention path (gather route): every K and V the model
stores is quantized and dequantized by the candidate (in float64) and written back in full precision, so
only the rounding differs between candidates. Quality as ``kvmesh bench kv_quant`` measures it (teacher-forced
top-1 agreement with the full-precision cache's greedy continuations of 16 chat prompts, and perplexity on
Python's pydoc topics text, and the top-1 agreement at each position of that text). Per token and KV head,
unless said otherwise:

- ``sym``: symmetric, ``absmax / 7`` (15 levels); ``asym``: 16 levels from the vector's min to max (a scale
  and a zero point); ``mse``: ``sym`` with the clipping ratio of least squared error; ``g32``: a scale (and
  zero) per 32 channels instead of per head.
- ``rot``: rotated by kvmesh's fixed randomized Hadamard matrix first (``kernels/quant.py``);
  ``c``: keys less their calibrated mean (exact for attention); ``s``: keys scaled per channel by
  ``sqrt(rms(q) / rms(k))`` from the calibration pass (queries by the inverse; exact for attention).
- ``block``: keys quantized **per channel over each 16-token cache block** (KIVI's axis), asymmetric, the
  block's min and max per channel kept as float16 or as fp8 e4m3 (min rounded down, max up; ``least-squares
  ends``: kvmesh's, each end rounded down or up, the pair of least squared error); ``written
  token by token``: as a paged cache would have to without a full-precision copy of the block being
  filled, each new key widens the block's ranges and re-rounds the keys already stored from their levels.
- ``sym16``: 16 levels -8..7, the e4m3 scale ``absmax / 8`` signed to put the largest magnitude on -8;
  ``int4 values``: kvmesh's (``quantize_int4_values``), that with the least-squares of a few clipped scales.
- ``k only`` / ``v only``: the other tensor left in full precision, to see which one the loss comes from;
  ``first token exact`` / ``first block exact``: a sequence's first 1 / 16 tokens left in full precision
  (what keeping the attention sink exact would buy).

Bytes are per token and KV head at head_dim 64, K and V averaged (a 16-bit cache: 128; the issue's 3.5x
capacity allows 36.6). Calibration is the engine's own: the fixed pseudo-random 256-token pass. Prints a
table, writes ``benchmarks/results/kv_int4_variants.json``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import kvmesh.kernels.torch_attention as torch_attention
from kvmesh.bench.harness.kv_quality import PROMPTS, perplexity_text, teacher_forced_logprobs, text_scores
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.kernels.quant import (
    dequantize,
    dequantize_int4_keys,
    e4m3_bits,
    e4m3_values,
    int4_rotation,
    quantize_int4_keys,
    quantize_int4_values,
)
from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.model_runner import CALIBRATION_TOKENS

Rounding = Callable[[torch.Tensor, int], torch.Tensor]
"""``(x, layer) -> x`` rounded as a candidate stores it; x is float64 [tokens, kv_heads, head_dim]."""
BLOCK = 16
HEAD_DIM = 64


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, group)


def sym(x: torch.Tensor, group: int = 0, clip: float = 1.0) -> torch.Tensor:
    g = grouped(x, group or x.shape[-1])
    s = (g.abs().amax(-1, keepdim=True) * clip / 7).clamp_min(1e-8)
    return ((g / s).round().clamp(-7, 7) * s).reshape(x.shape)


def sym_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``sym`` with its scale kept in one byte: fp8 e4m3, rounded up so that no value clips."""
    s = e4m3(x.abs().amax(-1, keepdim=True) / 7, up=True).clamp_min(1e-8)
    return (x / s).round().clamp(-7, 7) * s


def sym16_e4m3(x: torch.Tensor) -> torch.Tensor:
    """16 levels -8..7 (``sym_e4m3`` leaves one unused): the scale, ``absmax / 8`` in one e4m3 byte, takes
    the sign that puts the vector's largest magnitude at -8."""
    top = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    s = e4m3(x.abs().amax(-1, keepdim=True) / 8, up=True).clamp_min(1e-8) * torch.where(top > 0, -1.0, 1.0)
    return (x / s).round().clamp(-8, 7) * s


def int4_values(x: torch.Tensor) -> torch.Tensor:
    """kvmesh's int4 values: ``sym16_e4m3`` with the least-squares scale of ``INT4_VALUE_DIVISORS``."""
    packed, scales = quantize_int4_values(x)
    return dequantize(packed, scales, torch.float64)


def asym(x: torch.Tensor, group: int = 0) -> torch.Tensor:
    g = grouped(x, group or x.shape[-1])
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    return (((g - lo) / s).round().clamp(0, 15) * s + lo).reshape(x.shape)


def mse(x: torch.Tensor) -> torch.Tensor:
    best, err = sym(x), None
    for clip in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        y = sym(x, clip=clip)
        e = (y - x).pow(2).sum(-1, keepdim=True)
        best = y if err is None else torch.where(e < err, y, best)
        err = e if err is None else torch.minimum(e, err)
    return best


def e4m3(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` on fp8 e4m3's grid, rounded toward +inf (``up``) or -inf, as the engine stores int4 ranges."""
    return e4m3_values(e4m3_bits(x, up)).double()


def per_channel(g: torch.Tensor, params: str) -> torch.Tensor:
    """Blocks ``g`` ([blocks, slots, kv_heads, head_dim]) rounded per channel over their slots, asymmetric."""
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    if params == "e4m3":
        lo, hi = e4m3(lo, up=False), e4m3(hi, up=True)
    else:
        lo, hi = torch.minimum(lo.half().double(), lo), torch.maximum(hi.half().double(), hi)
    s = ((hi - lo) / 15).clamp_min(1e-10)
    return ((g - lo) / s).round().clamp(0, 15) * s + lo


def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """A sequence's ``x`` ([tokens, ...]) as cache blocks ([blocks, BLOCK, ...]; a teacher-forced sequence
    starts at slot 0), the last one padded with copies of its last token (they move no range)."""
    pad = -x.shape[0] % BLOCK
    return torch.cat([x, x[-1:].expand(pad, *x.shape[1:])]).reshape(-1, BLOCK, *x.shape[1:])


def int4_keys(x: torch.Tensor, layer: int) -> torch.Tensor:
    """kvmesh's int4 keys (``quantize_int4_keys``: e4m3 range ends of least squared error), whole blocks."""
    g = as_blocks(x)
    packed, ranges = quantize_int4_keys(g, torch.full((g.shape[0],), BLOCK))
    return dequantize_int4_keys(packed, ranges).double().flatten(0, 1)[: x.shape[0]]


def block_channel(params: str, token_by_token: bool = False) -> Rounding:
    """Keys per channel over each cache block; ``token_by_token``: re-rounded from the stored levels as each
    key arrives (no full-precision copy of the block being filled)."""

    def rounding(x: torch.Tensor, layer: int) -> torch.Tensor:
        n, g = x.shape[0], as_blocks(x)
        if not token_by_token:
            return per_channel(g, params).flatten(0, 1)[:n]
        stored = g.clone()
        for i in range(BLOCK):
            stored[:, : i + 1] = per_channel(torch.cat([stored[:, :i], g[:, i : i + 1]], 1), params)
        return stored.flatten(0, 1)[:n]

    return rounding


def per_token(quant: Callable, rotate: bool, center: bool = False, smooth: bool = False) -> Callable:
    """A per-token rounding inside kvmesh's exact transforms; bound to the calibration constants later."""

    def bind(consts: dict) -> Rounding:
        r = consts["rotation"] if rotate else torch.eye(consts["rotation"].shape[0], dtype=torch.float64)

        def rounding(x: torch.Tensor, layer: int) -> torch.Tensor:
            mu = consts["mean"][layer] if center else 0.0
            sm = consts["smooth"][layer] if smooth else 1.0
            return quant(((x - mu) * sm) @ r) @ r.T / sm + mu

        return rounding

    return bind


def fixed(rounding: Rounding) -> Callable:
    return lambda consts: rounding


def first_exact(bind: Callable, n: int) -> Callable:
    """``bind``'s rounding with a sequence's first ``n`` tokens left exact (the attention sink, or block 0)."""

    def exact_bind(consts: dict) -> Rounding:
        rounding = bind(consts)

        def exact(x: torch.Tensor, layer: int) -> torch.Tensor:
            y = rounding(x, layer).clone()
            y[:n] = x[:n]
            return y

        return exact

    return exact_bind


@dataclass(frozen=True)
class Candidate:
    """One layout: how K and V are rounded (None: kept in full precision), and its bytes per token-head."""

    name: str
    k: Callable | None
    v: Callable | None
    bytes: float | None = None


ROT_SYM = per_token(sym, True)
BLOCK_E4M3 = fixed(block_channel("e4m3"))
INT4_V = per_token(int4_values, True)
KEYS = fixed(int4_keys)
CANDIDATES = [
    Candidate("sym", per_token(sym, False), per_token(sym, False), 34),
    Candidate("rot sym (kvmesh's rotation alone)", ROT_SYM, ROT_SYM, 34),
    Candidate("rot sym, k only", ROT_SYM, None),
    Candidate("rot sym, v only", None, ROT_SYM),
    Candidate("rot c sym (kvmesh's int4 until 2026-11-27)", per_token(sym, True, True), ROT_SYM, 34),
    Candidate("rot mse", per_token(mse, True), per_token(mse, True), 34),
    Candidate("rot asym", per_token(asym, True), per_token(asym, True), 36),
    Candidate("rot c s sym", per_token(sym, True, True, True), ROT_SYM, 34),
    Candidate("rot c s asym", per_token(asym, True, True, True), per_token(asym, True), 36),
    Candidate(
        "rot c s asym g32",
        per_token(lambda x: asym(x, 32), True, True, True),
        per_token(lambda x: asym(x, 32), True),
        40,
    ),
    Candidate("rot sym g32", per_token(lambda x: sym(x, 32), True), per_token(lambda x: sym(x, 32), True), 36),
    Candidate("rot sym e4m3-scale, v only", None, per_token(sym_e4m3, True)),
    Candidate("rot sym16 e4m3 signed scale, v only", None, per_token(sym16_e4m3, True)),
    Candidate("rot int4 values (least-squares signed scale), v only", None, INT4_V),
    Candidate("block fp16, k only", fixed(block_channel("fp16")), None),
    Candidate("block e4m3, k only", BLOCK_E4M3, None),
    Candidate("block e4m3 written token by token, k only", fixed(block_channel("e4m3", True)), None),
    Candidate("block e4m3 + rot sym", BLOCK_E4M3, ROT_SYM, 37),
    Candidate("block e4m3 + rot sym e4m3-scale", BLOCK_E4M3, per_token(sym_e4m3, True), 36.5),
    Candidate("block e4m3 + rot sym16 e4m3 signed scale", BLOCK_E4M3, per_token(sym16_e4m3, True), 36.5),
    Candidate("block e4m3 + rot int4 values", BLOCK_E4M3, INT4_V, 36.5),
    Candidate("block e4m3 least-squares ends, k only", KEYS, None),
    Candidate("block e4m3 least-squares ends + rot int4 values (kvmesh's int4)", KEYS, INT4_V, 36.5),
    Candidate("... first token exact", first_exact(KEYS, 1), first_exact(INT4_V, 1)),
    Candidate("... first block exact", first_exact(KEYS, 16), first_exact(INT4_V, 16)),
    Candidate("block e4m3 token by token + rot int4 values", fixed(block_channel("e4m3", True)), INT4_V, 36.5),
]


def calibration(llm: LLM) -> dict:
    """Per layer: the calibration keys' mean and the smoothing factors, from the engine's calibration pass."""
    runner = llm.engine.runner
    queries: list[torch.Tensor] = []
    rotary = runner.model.layers[0].self_attn.rotary  # shared by every layer: called once per layer, in order
    hook = rotary.register_forward_hook(lambda module, args, out: queries.append(out[0].double()))
    try:
        kv = runner._calibration_kv()
    finally:
        hook.remove()
    mean, smooth = [], []
    for q, (k, _) in zip(queries, kv, strict=True):
        k = k.double()
        q_rms = q.view(q.shape[0], k.shape[1], -1, q.shape[-1]).pow(2).mean((0, 2)).sqrt()
        k_rms = (k - k.mean(0)).pow(2).mean(0).sqrt()
        mean.append(k.mean(0))
        smooth.append((q_rms / k_rms).clamp_min(1e-6).sqrt())
    head_dim = kv[0][0].shape[-1]
    return {"mean": mean, "smooth": smooth, "rotation": int4_rotation(head_dim, torch.float64, torch.device("cpu"))}


def simulate(k: Rounding | None, v: Rounding | None, layers: int) -> Callable:
    """A ``quantize`` for the torch path that rounds K and V as given and stores full precision."""
    calls = itertools.count()

    def quantize(x, cache_dtype, scale):
        i = next(calls)  # store_kv rounds K then V, layer after layer
        rounding = (k, v)[i % 2]
        y = x if rounding is None else rounding(x.double(), (i // 2) % layers)
        return y.to(cache_dtype), None

    return quantize


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench kv_int4_variants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ppl-chunks", type=int, default=8)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--only", default="", help="run only the candidates whose name contains this")
    args = ap.parse_args(argv)
    torch_attention.cpu_op = lambda name: None  # the gather route: the only one that calls ``quantize``
    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    chats = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = [o.token_ids for o in llm.generate(chats, params)]
    ids = llm.engine.tokenizer.encode(perplexity_text())
    chunks = [ids[i * args.ppl_tokens : (i + 1) * args.ppl_tokens] for i in range(args.ppl_chunks)]
    base, ref_top = text_scores(llm, chunks)
    consts = calibration(llm)
    layers, original = len(llm.engine.runner.kv_caches), torch_attention.quantize
    rows, results = [], []
    for c in (c for c in CANDIDATES if args.only in c.name):
        k, v = (None if bind is None else bind(consts) for bind in (c.k, c.v))
        torch_attention.quantize = simulate(k, v, layers)
        try:
            top1 = [
                float((teacher_forced_logprobs(llm, p + o, len(p)).argmax(-1) == torch.tensor(o)).float().mean())
                for p, o in zip(chats, outs, strict=True)
            ]
            ppl, top = text_scores(llm, chunks)
        finally:
            torch_attention.quantize = original
        capacity = None if c.bytes is None else 2 * HEAD_DIM / c.bytes
        results.append(
            {
                "candidate": c.name,
                "bytes_per_token_head": c.bytes,
                "capacity_vs_16bit": capacity,
                "teacher_forced_top1": float(np.mean(top1)),
                "text_top1": float((top == ref_top).float().mean()),
                "perplexity": ppl,
            }
        )
        rows.append(
            [
                c.name,
                "-" if c.bytes is None else f"{c.bytes:g} ({capacity:.2f}x)",
                f"{100 * np.mean(top1):.1f}%",
                f"{100 * float((top == ref_top).float().mean()):.2f}%",
                f"{ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)",
            ]
        )
        print(f"  {c.name}: done", flush=True)
    print(f"\nfull-precision perplexity {base:.3f}; calibration: {CALIBRATION_TOKENS} pseudo-random tokens")
    print_table(["candidate", "bytes / token-head", "teacher-forced top-1", "text top-1", "perplexity"], rows)
    if args.only:  # a subset: the results file keeps the whole table
        return
    write_json("kv_int4_variants", {"args": vars(args), "full_precision_perplexity": base, "candidates": results})


if __name__ == "__main__":
    main()
