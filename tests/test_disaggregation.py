"""Conditional disaggregation on real engines: one replica prefills a prompt, another fetches its KV and
decodes, and the client gets what a colocated request gives: the tokens, the log-probabilities (to fp32
rounding) and the usage (the prompt counted as computed, not cached, except what the prefiller held)."""

from __future__ import annotations

import asyncio
import dataclasses

from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.messages import KVFetch
from tests.serve_helpers import greedy_call

PROMPT = [(13 * i) % 6000 + 200 for i in range(300)]
LONGER = PROMPT + [(7 * i) % 5000 + 300 for i in range(100)]


async def run(replica: EngineReplica, call) -> tuple[list[int], list, object]:
    tokens, logprobs, usage = [], [], None
    async for chunk in replica.generate(call):
        tokens += chunk.token_ids
        logprobs += [(lp.token_id, lp.logprob, list(lp.top)) for lp in chunk.logprobs or []]
        usage = chunk.usage or usage
    return tokens, logprobs, usage


def test_a_disaggregated_request_streams_what_a_colocated_one_does(smollm_dir):
    config = EngineConfig(model=str(smollm_dir), num_kv_blocks=96, dtype="float32", torch_threads=1)
    prefiller, decoder = EngineReplica(config), EngineReplica(config)

    async def main():
        await prefiller.start_peer()
        await decoder.start_peer()
        call = greedy_call(str(smollm_dir), PROMPT, 8)
        call.params = dataclasses.replace(call.params, logprobs=3)
        colocated = await run(decoder, call)
        await decoder.llm.reset_prefix_cache()
        plan = KVFetch(holder=prefiller.index_id, address=prefiller.peer.address, num_blocks=18, prefill=True)
        split_call = dataclasses.replace(call, request_id="split", fetches={decoder.index_id: plan})
        split = await run(decoder, split_call)
        # A longer prompt on the same prefix, split again on a decoder that lost it: the prefiller finds the
        # first 288 tokens cached and computes the rest, and the usage says so.
        await decoder.llm.reset_prefix_cache()
        longer_plan = dataclasses.replace(plan, num_blocks=len(LONGER) // 16)
        longer = dataclasses.replace(greedy_call(str(smollm_dir), LONGER, 8), fetches={decoder.index_id: longer_plan})
        again = await run(decoder, longer)
        return colocated, split, again, prefiller.stats(), decoder.stats()

    try:
        colocated, split, again, held, took = asyncio.run(main())
    finally:
        prefiller.close()
        decoder.close()
    assert split[0] == colocated[0] and len(split[0]) == 8
    # The same log-probabilities and alternatives, to fp32 rounding: colocated, the prompt's last tokens attend to
    # K/V computed in the same step; split, to K/V read back from cached blocks (another summation order).
    for (token, lp, top), (token_c, lp_c, top_c) in zip(split[1], colocated[1], strict=True):
        assert token == token_c and [t for t, _ in top] == [t for t, _ in top_c]
        assert abs(lp - lp_c) < 1e-4 and all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(top, top_c, strict=True))
    assert split[2] == colocated[2] and split[2].cached_tokens == 0  # computed for this request: not a hit
    assert again[2].cached_tokens == 18 * 16 and again[2].prompt_tokens == len(LONGER)
    assert held.kv_prefills == 2 and held.kv_served_blocks == 18 + len(LONGER) // 16
    assert took.kv_fetched_blocks == held.kv_served_blocks and not took.kv_fetch_fallbacks
