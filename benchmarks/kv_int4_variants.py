"""How to scale a 4-bit KV cache: the candidate layouts side by side on SmolLM2, before committing to one.

    python -m benchmarks.kv_int4_variants [--model smollm2-135m] [--ppl-chunks 4]

Each candidate is simulated in the engine's own torch attention path (gather route): every K and V the model
stores is quantized and dequantized by the candidate (in float64) and written back in full precision, so
only the rounding differs between candidates. Quality as ``benchmarks.kv_quant`` measures it (teacher-forced
top-1 agreement with the full-precision cache's greedy continuations of 16 chat prompts, and perplexity on
Python's pydoc topics text). Candidates, per token and KV head unless grouped:

- ``sym``: symmetric, ``absmax / 7`` (15 levels); ``asym``: 16 levels from the vector's min to max (a scale
  and a zero point: 4 bytes per token-head instead of 2); ``mse``: ``sym`` with the clipping ratio of least
  squared error; ``g32``: a scale (and zero) per 32 channels instead of per head (twice the scale bytes).
- ``rot``: rotated by kvmesh's fixed randomized Hadamard matrix first (``kvmesh/kernels/quant.py``).
- ``c``: keys less their calibrated mean (exact for attention); ``s``: keys scaled per channel by
  ``sqrt(rms(q) / rms(k))`` from the calibration pass (queries by the inverse; exact for attention).
- ``k only`` / ``v only``: the other tensor left in full precision, to see which one the loss comes from.

Calibration is the engine's own: the fixed pseudo-random 256-token pass. Prints a table, writes
``benchmarks/results/kv_int4_variants.json``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import kvmesh.kernels.torch_attention as torch_attention
from benchmarks.kv_quant import PROMPTS, perplexity, perplexity_text, teacher_forced_logprobs
from kvmesh.bench.report import print_table, write_json
from kvmesh.kernels.quant import int4_rotation
from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.model_runner import CALIBRATION_TOKENS

Quantizer = Callable[[torch.Tensor], torch.Tensor]


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, group)


def sym(x: torch.Tensor, group: int = 0, clip: float = 1.0) -> torch.Tensor:
    g = grouped(x, group or x.shape[-1])
    s = (g.abs().amax(-1, keepdim=True) * clip / 7).clamp_min(1e-8)
    return ((g / s).round().clamp(-7, 7) * s).reshape(x.shape)


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


@dataclass(frozen=True)
class Candidate:
    """One layout: how K and V are rounded, and the exact transforms around the rounding."""

    name: str
    quant: Quantizer
    rotate: bool
    center: bool
    smooth: bool
    only: str = "kv"

    def fake(self, x: torch.Tensor, part: str, layer: int, consts: dict) -> torch.Tensor:
        if part not in self.only:
            return x
        xd = x.double()
        mu = consts["mean"][layer] if self.center and part == "k" else 0.0
        sm = consts["smooth"][layer] if self.smooth and part == "k" else 1.0
        r = consts["rotation"] if self.rotate else torch.eye(xd.shape[-1], dtype=torch.float64)
        return (self.quant(((xd - mu) * sm) @ r) @ r.T / sm + mu).to(x.dtype)


CANDIDATES = [
    Candidate("sym", sym, False, False, False),
    Candidate("rot sym (kvmesh's rotation alone)", sym, True, False, False),
    Candidate("rot sym, k only", sym, True, False, False, "k"),
    Candidate("rot sym, v only", sym, True, False, False, "v"),
    Candidate("rot c sym (kvmesh int4)", sym, True, True, False),
    Candidate("rot mse", mse, True, False, False),
    Candidate("rot asym", asym, True, False, False),
    Candidate("rot c asym", asym, True, True, False),
    Candidate("rot c s sym", sym, True, True, True),
    Candidate("rot c s asym", asym, True, True, True),
    Candidate("rot sym g32", lambda x: sym(x, 32), True, False, False),
    Candidate("rot c s asym g32", lambda x: asym(x, 32), True, True, True),
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


def simulate(candidate: Candidate, consts: dict, layers: int) -> Callable:
    """A ``quantize`` for the torch path that rounds as ``candidate`` and stores full precision."""
    calls = itertools.count()

    def quantize(x, cache_dtype, scale):
        i = next(calls)  # store_kv rounds K then V, layer after layer
        return candidate.fake(x, "kv"[i % 2], (i // 2) % layers, consts).to(cache_dtype), None

    return quantize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ppl-chunks", type=int, default=4)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    args = ap.parse_args()
    torch_attention.cpu_op = lambda name: None  # the gather route: the only one that calls ``quantize``
    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    chats = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = [o.token_ids for o in llm.generate(chats, params)]
    ids = llm.engine.tokenizer.encode(perplexity_text())
    chunks = [ids[i * args.ppl_tokens : (i + 1) * args.ppl_tokens] for i in range(args.ppl_chunks)]
    base = perplexity(llm, chunks)
    consts = calibration(llm)
    layers, original = len(llm.engine.runner.kv_caches), torch_attention.quantize
    rows, results = [], []
    for candidate in CANDIDATES:
        torch_attention.quantize = simulate(candidate, consts, layers)
        try:
            top1 = [
                float((teacher_forced_logprobs(llm, c + o, len(c)).argmax(-1) == torch.tensor(o)).float().mean())
                for c, o in zip(chats, outs, strict=True)
            ]
            ppl = perplexity(llm, chunks)
        finally:
            torch_attention.quantize = original
        results.append({"candidate": candidate.name, "teacher_forced_top1": float(np.mean(top1)), "perplexity": ppl})
        rows.append([candidate.name, f"{100 * np.mean(top1):.1f}%", f"{ppl:.3f} ({100 * (ppl / base - 1):+.2f}%)"])
        print(f"  {candidate.name}: done", flush=True)
    print(f"\nfull-precision perplexity {base:.3f}; calibration: {CALIBRATION_TOKENS} pseudo-random tokens")
    print_table(["candidate", "teacher-forced top-1", "perplexity"], rows)
    write_json("kv_int4_variants", {"args": vars(args), "full_precision_perplexity": base, "candidates": results})


if __name__ == "__main__":
    main()
