"""The sampler against its definition: empirical frequencies over many seeded draws match the exact
renormalised temperature / top-k / top-p / min-p distribution (chi-square), on every path (candidates for
top-k, rejection over the whole row compiled and in torch, the sort fallback), and a seeded row's token
does not depend on its batch."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from kvmesh.replica.sampler import MAX_TOP_K, SamplingColumns, SamplingTensors, sample, uniforms

DRAWS = 20_000


@pytest.fixture(params=["compiled", "torch"], autouse=True)
def rejection_path(request, monkeypatch):
    """Every test runs with the compiled CPU rejection kernel and with the torch path that serves without
    a compiler (and on GPUs)."""
    import kvmesh.replica.sampler

    if request.param == "torch":
        monkeypatch.setattr(kvmesh.replica.sampler, "cpu_op", lambda name: None)
    elif kvmesh.replica.sampler.cpu_op("sample_rows") is None:
        pytest.skip("the CPU kernels could not be built here")
    return request.param


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The definition, in float64 with a full sort: softmax(logits / T) over the top-k, renormalised; the
    smallest most-likely prefix reaching top_p; less tokens under min_p x the most likely; renormalised."""
    x = logits.double() / temperature
    vals, idx = x.sort(descending=True)
    if top_k:
        vals = vals.clone()
        vals[top_k:] = float("-inf")
    p = vals.softmax(-1)
    keep = (p.cumsum(-1) - p) < top_p
    keep &= p >= min_p * p[0]
    q = torch.zeros_like(p)
    q[keep] = p[keep] / p[keep].sum()
    return torch.zeros_like(q).scatter_(0, idx, q)


def draws(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    rows = logits.expand(n, -1).contiguous()
    seeds = torch.arange(n).mul_(7919).add_(12345).tolist()
    columns = SamplingColumns(
        temperature=[params.get("temperature", 1.0)] * n,
        top_k=[params.get("top_k", 0)] * n,
        top_p=[params.get("top_p", 1.0)] * n,
        min_p=[params.get("min_p", 0.0)] * n,
        seed=seeds,
        position=[3] * n,
    )
    st = SamplingTensors.build(columns, torch.device("cpu"))
    return sample(rows, st)


def assert_matches(logits: torch.Tensor, **params) -> None:
    expected = reference(
        logits[0],
        params.get("temperature", 1.0),
        params.get("top_k", 0),
        params.get("top_p", 1.0),
        params.get("min_p", 0.0),
    )
    tokens = draws(logits, DRAWS, **params)
    counts = torch.bincount(tokens, minlength=logits.shape[1]).double()
    assert counts[expected == 0].sum() == 0, "a token outside the kept set was drawn"
    exp = expected[expected > 0] * DRAWS
    obs = counts[expected > 0]
    big = exp >= 5  # pool the rare tokens into one bin, as chi-square needs
    f_obs = torch.cat([obs[big], obs[~big].sum(0, keepdim=True)]) if (~big).any() else obs
    f_exp = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)]) if (~big).any() else exp
    p_value = chisquare(f_obs.numpy(), f_exp.numpy()).pvalue
    assert p_value > 1e-4, (params, p_value)


def peaked(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, vocab, generator=g) * 3).float()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},  # no filter: the whole vocabulary in index order
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},  # the cut lies among the candidates
        {"top_k": 20, "top_p": 0.9},
        {"min_p": 0.05},
        {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01},
    ],
)
def test_frequencies_match_the_definition(params):
    assert_matches(peaked(256), **params)


def test_flat_rows_small_nuclei_and_huge_top_k_match_too():
    """A flat row (the nucleus spans most of the vocabulary), a small top_p (most rejection rounds reject:
    some rows reach the sort), and a top-k beyond the candidates (sorted)."""
    flat = torch.randn(1, 2 * MAX_TOP_K, generator=torch.Generator().manual_seed(1)) * 0.1
    assert_matches(flat, top_p=0.95)
    assert_matches(peaked(256, seed=4), top_p=0.05, temperature=3.0)
    assert_matches(flat, top_k=MAX_TOP_K + 500, temperature=2.0)
    assert_matches(flat, top_k=MAX_TOP_K + 500, top_p=0.5)


def test_greedy_rows_take_the_argmax_and_seeded_rows_ignore_their_batch():
    logits = peaked(512, seed=2).expand(6, -1).contiguous()
    logits[3] = peaked(512, seed=3)
    columns = SamplingColumns(
        temperature=[0.0, 1.0, 1.0, 1.0, 0.0, 1.0],
        top_k=[0, 0, 10, 1, 0, 0],
        top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.5],
        min_p=[0.0] * 6,
        seed=[1, 2, 3, 4, 5, 6],
        position=[0, 1, 2, 3, 4, 5],
    )
    st = SamplingTensors.build(columns, torch.device("cpu"))
    batch = sample(logits, st)
    assert batch[0] == batch[4] == logits[0].argmax() and batch[3] == logits[3].argmax()  # temperature 0, top_k 1
    for i in (1, 2, 5):
        alone = SamplingTensors.build(columns.row(i), torch.device("cpu"))
        assert sample(logits[i : i + 1], alone).item() == batch[i]
        assert sample(logits[i : i + 1], st.row(i)).item() == batch[i]


def test_uniforms_are_uniform_and_depend_on_seed_and_position():
    seeds = torch.arange(50_000, dtype=torch.int64) * 2654435761 - 2**62
    u = uniforms(seeds, torch.full_like(seeds, 7))
    assert u.min() > 0 and u.max() < 1
    counts = torch.bincount((u * 50).long(), minlength=50).double()
    assert chisquare(counts.numpy()).pvalue > 1e-4
    assert not torch.equal(u, uniforms(seeds, torch.full_like(seeds, 8)))
    assert torch.equal(u, uniforms(seeds.clone(), torch.full_like(seeds, 7)))


def test_argmax_takes_the_first_of_tied_maxima_like_torch():
    from kvmesh.replica.sampler import argmax

    x = torch.randn(7, 3000, generator=torch.Generator().manual_seed(3))
    x[2, 10] = x[2, 2500] = x[5, 0] = x[5, 2999] = 99.0
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(x)[2] == 10 and argmax(x)[5] == 0
