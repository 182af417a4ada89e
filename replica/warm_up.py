"""Warming an engine up before it serves: a few dummy requests prefilled and decoded, then forgotten.

Routers turn queues into seconds with the replica's measured prefill rate and weigh a decode batch by its
marginal cost per sequence, which a replica can only measure from steps of different sizes; without this, a
fresh replica would report nothing until traffic happened to vary its batch, and routers would guess. The
first prefill builds kernels and runs slower than serving will, so the rate reported comes from a second one.
It also warms the kernels, so the first user does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.replica.engine import LLMEngine


def warm_up_engine(engine: LLMEngine, batch: int = 8, steps: int = 4) -> None:
    """Prefill ``batch`` dummy requests twice (cold, then measured), decode them ``steps`` steps at that batch
    and at one; leaves no trace: blocks, cache and counters are reset."""
    n = max(2, min(batch, engine.scheduler.max_num_seqs))
    params = SamplingParams(max_tokens=2 * steps + 2, temperature=0, ignore_eos=True)
    vocab = engine.loaded.config.vocab_size
    size = engine.block_size
    per_seq = max(1, min(4, engine.num_blocks // n - 1, engine.config.max_num_batched_tokens // (n * size)))

    def prompts(first: int) -> list[str]:
        """``n`` prompts of ``per_seq`` blocks no earlier prompt shares, added; their ids."""
        tokens = per_seq * size
        return [
            engine.add_request([(first + 97 * i + k) % vocab for k in range(tokens)], params, f"warm-up-{first}-{i}")
            for i in range(n)
        ]

    cold = prompts(1000)
    engine.step()  # prefill all, cold
    for rid in cold:
        engine.abort_request(rid)
    engine.drain()
    engine.rates.forget_prefill()
    rids = prompts(5000)
    engine.step()  # prefill all again: the rate routers are told
    for running in (n, 1):
        for rid in rids[running:]:
            engine.abort_request(rid)
        for _ in range(steps):
            engine.step()
    for rid in rids:
        engine.abort_request(rid)
    engine.drain()
    engine.reset_prefix_cache()
    engine.scheduler.reset_counters()
