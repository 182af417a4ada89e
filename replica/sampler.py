"""Token sampling for a batch with per-request settings: greedy, temperature, top-k, top-p, seed.

Filtering is vectorised over the batch. The random draw uses the exponential-race form of categorical
sampling (``argmax(p / E)`` with ``E ~ Exp(1)``), which lets each seeded request draw its noise from its
own generator, so its output does not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from replica.request import Request


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of ``logits`` ([batch, vocab], fp32), following each request's params."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        params = [requests[i].params for i in rows]
        temp = torch.tensor([p.temperature for p in params], device=logits.device)
        top_k = torch.tensor([p.top_k for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        scaled = logits[idx] / temp[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(-1)
        noise = torch.empty(probs.shape)  # drawn on the CPU, where the per-request generators live
        for j, i in enumerate(rows):
            noise[j].exponential_(generator=requests[i].generator)
        tokens[idx] = (probs / noise.to(probs.device)).argmax(dim=-1)
    return tokens.tolist()
