"""``LLM`` closes like a file: closing releases its engine and, with a disk tier, the directory's slot, so the
next ``LLM`` on that directory in the same process takes the same slot and starts warm from what it spilled."""

from __future__ import annotations

import pytest

from kvmesh.replica import LLM, SamplingParams
from tests.test_disk_tier import BLOCK, FOLLOW_UP

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_a_closed_llm_hands_its_warm_disk_directory_to_the_next(tiny_llama_dir, tmp_path):
    settings = dict(
        block_size=BLOCK,
        num_kv_blocks=24,
        swap_space_bytes=0,
        host_cache_bytes=1 << 20,  # room for the whole prompt in the host tier, through which disk blocks load
        disk_cache_dir=str(tmp_path),
        max_num_batched_tokens=512,
    )
    with LLM(str(tiny_llama_dir), **settings) as first:
        assert first.engine.swap.disk.root == tmp_path
        (cold,) = first.generate(FOLLOW_UP, GREEDY)
    assert first.closed and cold.num_cached_tokens == 0
    with pytest.raises(ValueError, match="closed"):
        first.generate(FOLLOW_UP, GREEDY)
    first.close()  # a second close does nothing

    with LLM(str(tiny_llama_dir), **settings) as second:
        disk = second.engine.swap.disk
        disk.read_bytes_s = 1e12  # as test_disk_tier's engines: the tiny model recomputes faster than a disk reads
        assert disk.root == tmp_path, "the first LLM's slot, not slot-1"
        assert disk.adopted == 10, "the prompt's ten full blocks, spilled when the first closed"
        (warm,) = second.generate(FOLLOW_UP, GREEDY)
    assert warm.num_cached_tokens == 10 * BLOCK
    assert warm.token_ids == cold.token_ids, "blocks read back from disk give the tokens computing them gives"
