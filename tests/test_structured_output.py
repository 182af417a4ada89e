"""Structured output on a real model (SmolLM2): sampled answers always parse and validate against the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvmesh.core.errors import InvalidRequest
from kvmesh.replica import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON with name, age and pets.<|im_end|>\n<|im_start|>assistant\n"


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(str(smollm_dir), num_kv_blocks=256, max_num_seqs=32)


def test_sampled_answers_validate_against_the_schema(llm):
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, json_schema=json.dumps(SCHEMA)) for s in range(20)]
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=0)
    outs = llm.generate([PROMPT] * 21, [*params, free])  # constrained rows share a batch with a free one
    for out in outs[:20]:
        assert out.finish_reason == "stop" and valid(out.text), out.text
    assert not valid(outs[20].text)  # the unconstrained neighbour was not masked


def test_json_object_and_forked_sequences(llm):
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=3, json_schema=json.dumps(SCHEMA))
    outs = llm.generate(PROMPT, params)
    assert len(outs) == 3 and len({o.text for o in outs}) > 1  # each sequence its own matcher and draws
    assert all(valid(out.text) for out in outs), [out.text for out in outs]
    any_object = SamplingParams(max_tokens=120, temperature=0, json_schema=json.dumps({"type": "object"}))
    out = llm.generate(PROMPT, any_object)[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_a_schema_that_cannot_compile_is_refused_naming_response_format(llm):
    bad = json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(InvalidRequest) as err:
        llm.engine.add_request(PROMPT, SamplingParams(json_schema=bad))
    assert err.value.param == "response_format"
