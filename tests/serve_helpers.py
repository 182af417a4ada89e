"""Calls to the engine deployment's handle, built as the ingress builds them."""

from __future__ import annotations

import uuid

from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import GenerateCall
from kvmesh.core.sampling_params import SamplingParams

ENGINE_SLOT = "kvmesh_test_engine_slot"
"""A custom resource the shared test Ray session has once: an engine claiming it stands in for a GPU engine."""


def greedy_call(model: str, tokens: list[int], max_tokens: int, session: str | None = None) -> GenerateCall:
    """A ``GenerateCall`` for ``tokens``: greedy, exactly ``max_tokens`` long, 16-token blocks hashed."""
    return GenerateCall(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tokens,
        block_hashes=hash_blocks(tokens, 16, model_seed(model)),
        block_size=16,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        session_id=session,
    )
