"""The CUDA-graph decode path's own logic, on the CPU: bucket choice and padding.

A decode batch replayed from a graph runs on static buffers padded up to its bucket (``replica/cuda_graphs``).
On the CPU the same path runs eagerly (``capture=False``): batch sizes that change every step (requests
finishing, preemption, forks joining) must give exactly the outputs of the plain path, with the async
loop's device-filled inputs. Capture and replay themselves are CUDA's: ``tests/test_gpu.py``.
"""

from __future__ import annotations

from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
from kvmesh.replica.cuda_graphs import default_sizes


def outputs(model_dir, graphs: bool) -> dict:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=12, max_num_seqs=8, max_num_batched_tokens=48))
    if graphs:
        engine.runner.capture_decode_graphs([1, 2, 4, 8], capture=False)
    work = [
        (list(range(100, 100 + 20 + 7 * i)), SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True))
        for i in range(5)
    ]
    # Greedy: padding changes the GEMMs' row count, whose last-bit differences a sampled draw near a
    # boundary can feel (the same holds for any change of batch); greedy argmaxes of this model do not.
    work.append((list(range(400, 430)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3)))
    for i, (prompt, params) in enumerate(work):
        engine.add_request(prompt, params, f"r{i}")
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[(out.request_id, out.index)] = out.token_ids
        engine.check_integrity()
    assert engine.stats().num_preemptions > 0, "the pool was meant to overflow"
    if graphs:
        assert engine.runner.graphs.steps > 10 and engine.runner.graphs.padded_steps > 3
    return final


def test_padded_static_decode_path_gives_the_plain_paths_tokens(tiny_llama_dir):
    assert outputs(tiny_llama_dir, graphs=True) == outputs(tiny_llama_dir, graphs=False)


def test_default_sizes_cover_every_batch_up_to_max_num_seqs():
    assert default_sizes(1) == [1] and default_sizes(6) == [1, 2, 4, 6]
    sizes = default_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and sizes == sorted(set(sizes))
