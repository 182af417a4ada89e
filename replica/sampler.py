"""Token sampling on the logits' device, vectorised over the batch: greedy, temperature, top-k, top-p, min-p.

The distribution of a row: ``softmax(logits / temperature)`` over its ``top_k`` most likely tokens (0: all),
renormalised; then the smallest set of most likely tokens whose mass reaches ``top_p`` (the first always
kept), less the tokens whose probability is under ``min_p`` x the most likely one's, renormalised. Greedy
rows (temperature 0 or ``top_k`` 1) take the argmax.

Nothing sorts the vocabulary unless a row asks for a very large top-k. Each row takes one of two paths:

- ``top_k`` up to ``MAX_TOP_K``: one ``topk`` (sorted) of the batch's largest top-k; the top-p / min-p cut
  is found among those candidates, the draw inverts their cumulative distribution.
- no ``top_k``: rejection. Draw a token from the whole row by inverting its cumulative distribution in
  index order; keep it if it belongs to the kept set (the mass of the tokens more likely than it is under
  ``top_p``, its probability at least ``min_p`` x the top one's), else draw again. Sampling a distribution
  and keeping only the draws in a set samples exactly that distribution restricted to the set and
  renormalised; a round costs a few passes over the row and keeps a draw with probability >= top_p, so
  high top_p (the usual 0.9-1) needs one or two rounds, and rows still unlucky after ``MAX_ROUNDS`` sort.

Every draw takes a uniform number from a counter-based hash of the sequence's seed, its output position and
the round, computed for all rows at once: a seeded request gets the same tokens whatever shares its batch
(and after a preemption), and an unseeded request gets a random seed when it is created. The hash keeps
its arithmetic below 2**63, so it is exact in int64 on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.core.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from kvmesh.kernels.cpu_extension import cpu_op

MAX_TOP_K = 1024
"""Largest ``top_k`` served from one ``topk`` of candidates; a larger one sorts its row."""
CACHE_BYTES = 4 << 20
"""Working set of one group of rows in the CPU rejection sampler: rows that stay in cache between passes
(a whole batch over a 49k vocabulary is tens of MB, and each pass would go to memory)."""
MAX_ROUNDS = 16
"""Rejection rounds before a row's last resort, a sort (its kept set holds under ~1/16 of the mass)."""
_MASK32 = 0xFFFFFFFF


@dataclass(slots=True, kw_only=True)
class SamplingColumns:
    """One step's per-row sampling settings as host lists: the one definition of the sampling columns. A
    new sampling parameter is a field here (with its tensor dtype and neutral value) and its op in ``sample``."""

    temperature: list[float]
    top_k: list[int]  # 0 = off
    top_p: list[float]
    min_p: list[float]
    seed: list[int]  # a 64-bit seed as two's complement
    position: list[int]  # the output position being sampled

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> SamplingColumns:
        return cls(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p for p in params],
            min_p=[p.min_p for p in params],
            seed=seeds,
            position=positions,
        )

    def row(self, i: int) -> SamplingColumns:
        return SamplingColumns(**{name: [getattr(self, name)[i]] for name in COLUMNS})

    def neutralise(self, i: int) -> None:
        """Row ``i`` sampled greedily with neutral settings (its own could not be turned into tensors)."""
        for name, (_, neutral) in COLUMNS.items():
            getattr(self, name)[i] = neutral


COLUMNS: dict[str, tuple[torch.dtype, float | int]] = {
    "temperature": (torch.float32, 0.0),
    "top_k": (torch.int64, 0),
    "top_p": (torch.float32, 1.0),
    "min_p": (torch.float32, 0.0),
    "seed": (torch.int64, 0),
    "position": (torch.int64, 0),
}
"""Each ``SamplingColumns`` field: its tensor dtype and the value that leaves a row greedy and uncut."""


@dataclass(slots=True, kw_only=True)
class SamplingTensors:
    """Per-row settings of one step's sampling rows, on the logits' device (``SamplingColumns``' fields as
    tensors). Which rows take which path is decided on the host, from the settings, so no path needs a
    data-dependent sync to be chosen."""

    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    position: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    """int64: the rows that are not greedy (None: all greedy)."""
    by_top_k: torch.Tensor | None = None
    """int64, among ``sampled``: rows with 0 < top_k <= MAX_TOP_K."""
    by_rejection: torch.Tensor | None = None
    """int64, among ``sampled``: rows without top_k."""
    by_sort: torch.Tensor | None = None
    """int64, among ``sampled``: rows with top_k > MAX_TOP_K."""
    max_top_k: int = 0

    @classmethod
    def build(cls, columns: SamplingColumns, device: torch.device) -> SamplingTensors:
        """From one step's columns (built once per step): a handful of tensor copies."""
        pairs = zip(columns.temperature, columns.top_k, strict=True)
        sampled = [i for i, (t, k) in enumerate(pairs) if t >= GREEDY_TEMPERATURE and k != 1]
        ks = [columns.top_k[i] for i in sampled]
        by_top_k = [j for j, k in enumerate(ks) if 0 < k <= MAX_TOP_K]
        paths = {
            "sampled": sampled,
            "by_top_k": by_top_k,
            "by_rejection": [j for j, k in enumerate(ks) if k == 0],
            "by_sort": [j for j, k in enumerate(ks) if k > MAX_TOP_K],
        }

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            **{name: tensor(getattr(columns, name), dtype) for name, (dtype, _) in COLUMNS.items()},
            **{name: tensor(rows, torch.int64) if rows else None for name, rows in paths.items()},
            max_top_k=max((ks[j] for j in by_top_k), default=0),
        )

    def row(self, i: int) -> SamplingTensors:
        """Row ``i`` alone (to sample rows one at a time after a batch failed)."""
        values = {name: getattr(self, name)[i : i + 1].tolist() for name in COLUMNS}
        return SamplingTensors.build(SamplingColumns(**values), self.temperature.device)


GREEDY = SamplingTensors()
"""Settings of a step whose rows are all greedy: ``sample`` takes the argmax and reads nothing else."""


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` < 2**32, without an int64 product over 2**63."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (the "lowbias32" constants): every input bit flips half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed: torch.Tensor, position: torch.Tensor, round_: int | torch.Tensor = 0) -> torch.Tensor:
    """One number in (0, 1) per row (and round), a function of (seed, position, round) alone (float64);
    the arguments broadcast, so ``round_`` may be a row of rounds."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    rounds = torch.as_tensor(round_, dtype=torch.int64, device=seed.device)
    h = _mix32(lo ^ _mix32(hi ^ _mix32((position & _MASK32) ^ _mix32(rounds))))
    h = _mix32(h ^ 0x9E3779B9)
    return (h.double() + 0.5) * (1.0 / 2**32)


def _pick(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index where ``u`` of each row's total mass is reached in its non-decreasing ``cdf``."""
    target = (u * cdf[:, -1].double()).to(cdf.dtype)[:, None]
    return torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1).squeeze(1)


def _pick_blocked(p: torch.Tensor, u: torch.Tensor, block: int = 64) -> torch.Tensor:
    """``_pick`` on a row of probabilities without its full cumulative sum: sums of blocks of ``block``
    tokens find the block holding the target, and only that block is accumulated (a cumulative sum runs
    token by token; a block sum is one vectorised pass)."""
    rows, vocab = p.shape
    full = vocab // block * block
    sums = p[:, :full].reshape(rows, -1, block).sum(dim=-1)
    if full < vocab:
        sums = torch.cat([sums, p[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    csum = sums.cumsum(dim=-1)
    target = (u * csum[:, -1].double()).to(p.dtype)[:, None]
    k = torch.searchsorted(csum, target).clamp_(max=csum.shape[1] - 1)
    before = torch.where(k > 0, csum.gather(1, (k - 1).clamp(min=0)), 0.0)
    idx = k * block + torch.arange(block, device=p.device)[None, :]
    inner = p.gather(1, idx.clamp(max=vocab - 1)).masked_fill_(idx >= vocab, 0.0).cumsum_(dim=-1).add_(before)
    off = torch.searchsorted(inner, target).clamp_(max=block - 1)
    return (k * block + off).clamp_(max=vocab - 1).squeeze(1)


def _keep(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, in_k: torch.Tensor) -> torch.Tensor:
    """The kept tokens among a row's most likely ones (sorted, descending; ``probs`` normalised within its
    top-k set): in the top-k, in the top-p prefix, and at least min_p x the first's probability."""
    excl = probs.cumsum(dim=-1) - probs
    return in_k & (excl < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])


def _sample_top_k(x: torch.Tensor, s: SamplingTensors, rows: torch.Tensor) -> torch.Tensor:
    """Rows whose top-k set fits the candidates: its cut and draw among them (exact, no sort)."""
    k = min(x.shape[1], s.max_top_k)
    vals, idx = x.topk(k, dim=-1)  # sorted, descending
    top_k = s.top_k[rows]
    in_k = torch.arange(k, device=x.device)[None, :] < top_k[:, None]
    probs = torch.softmax(vals.masked_fill(~in_k, float("-inf")), dim=-1)
    keep = _keep(probs, s.top_p[rows], s.min_p[rows], in_k)
    j = _pick((probs * keep).cumsum(dim=-1), uniforms(s.seed[rows], s.position[rows]))
    return idx.gather(1, j[:, None]).squeeze(1)


def _sample_sorted(x: torch.Tensor, s: SamplingTensors, rows: torch.Tensor, round_: int = 0) -> torch.Tensor:
    """The last resort: sort the whole row, then the same cut and draw as for candidates."""
    vals, idx = x.sort(dim=-1, descending=True)
    top_k = s.top_k[rows]
    ranks = torch.arange(x.shape[1], device=x.device)[None, :]
    in_k = (ranks < top_k[:, None]) | (top_k[:, None] == 0)
    probs = torch.softmax(vals.masked_fill(~in_k, float("-inf")), dim=-1)
    keep = _keep(probs, s.top_p[rows], s.min_p[rows], in_k)
    j = _pick((probs * keep).cumsum_(dim=-1), uniforms(s.seed[rows], s.position[rows], round_))
    return idx.gather(1, j[:, None]).squeeze(1)


def _sample_rejection_compiled(x: torch.Tensor, s: SamplingTensors, rows: torch.Tensor) -> torch.Tensor | None:
    """The rejection path in one compiled CPU kernel (``kernels/csrc/sample_cpu.cpp``); None without it."""
    kernel = cpu_op("sample_rows") if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if kernel is None:
        return None
    rounds = torch.arange(MAX_ROUNDS, device=x.device)[None, :]
    u = uniforms(s.seed[rows, None], s.position[rows, None], rounds)
    out = torch.empty(len(rows), dtype=torch.int64)
    kernel(x.contiguous(), s.top_p[rows], s.min_p[rows], u, out)
    left = (out < 0).nonzero().squeeze(1)
    if len(left):
        out[left] = _sample_sorted(x[left], s, rows[left], MAX_ROUNDS)
    return out


def _sample_rejection(
    x: torch.Tensor, s: SamplingTensors, rows: torch.Tensor, first: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows without top-k: draw from the whole row, keep draws inside the top-p / min-p set.

    On the CPU the compiled kernel does it where it could be built; otherwise the rows go a group at a time,
    so each pass reads what the previous one left in cache. ``first``: the rows' uniform numbers of round 0
    (drawn for all groups at once)."""
    if first is None and (compiled := _sample_rejection_compiled(x, s, rows)) is not None:
        return compiled
    first = uniforms(s.seed[rows], s.position[rows]) if first is None else first
    chunk = len(rows) if x.is_cuda else max(1, CACHE_BYTES // (4 * x.shape[1]))
    if len(rows) > chunk:
        groups = range(0, len(rows), chunk)
        return torch.cat(
            [_sample_rejection(x[i : i + chunk], s, rows[i : i + chunk], first[i : i + chunk]) for i in groups]
        )
    p = torch.softmax(x, dim=-1)
    top_p, min_p = s.top_p[rows], s.min_p[rows]
    floor = min_p * p.amax(dim=-1)
    filtered = (top_p < 1) | (min_p > 0)
    vocab = x.shape[1]
    out = torch.empty(len(rows), dtype=torch.int64, device=x.device)
    left = torch.arange(len(rows), device=x.device)
    for round_ in range(MAX_ROUNDS):
        sub = left if round_ else slice(None)  # the first round reads every row in place, no copy
        u = uniforms(s.seed[rows[sub]], s.position[rows[sub]], round_) if round_ else first
        ps = p[sub]
        j = _pick_blocked(ps, u)
        pj = ps.gather(1, j[:, None])
        # Kept: the tokens more likely than j hold under top_p of the mass, and j is not under the min-p
        # floor. Their mass, from two cheap reductions: sum(max(p, pj)) = above + pj * (vocab - n_above).
        n_above = torch.count_nonzero(ps > pj, dim=-1)
        above = torch.clamp(ps, min=pj).sum(dim=-1) - pj.squeeze(1) * (vocab - n_above)
        accept = ~filtered[sub] | ((above < top_p[sub] * ps.sum(dim=-1)) & (pj.squeeze(1) >= floor[sub]))
        out[left[accept]] = j[accept]
        left = left[~accept]
        if not len(left):
            return out
    out[left] = _sample_sorted(x[left], s, rows[left], MAX_ROUNDS)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (the first, on ties): the compiled kernel on the CPU where it is built."""
    kernel = cpu_op("argmax_rows") if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernel is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.contiguous(), out)
    return out


def sample(logits: torch.Tensor, s: SamplingTensors) -> torch.Tensor:
    """One token id per row of ``logits`` ([rows, vocab], fp32), on the logits' device."""
    if s.sampled is None:
        return argmax(logits)
    rows = s.sampled
    if len(rows) == logits.shape[0]:  # every row samples: scale in place
        tokens = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        x = logits.div_(s.temperature[:, None])
    else:
        tokens = argmax(logits)
        x = logits[rows].div_(s.temperature[rows, None])
    chosen = torch.empty_like(rows)
    paths = ((s.by_top_k, _sample_top_k), (s.by_rejection, _sample_rejection), (s.by_sort, _sample_sorted))
    for subset, path in paths:
        if subset is not None:
            chosen[subset] = path(x[subset] if len(subset) < len(rows) else x, s, rows[subset])
    tokens[rows] = chosen
    return tokens
