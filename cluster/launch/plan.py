"""``kvmesh plan``: size a GPU pool by KV memory, for every KV cache dtype, from a model's config alone.

Users buy and scale replicas by how many sequences of their workload fit in each replica's KV pool. This
answers that before anything is deployed or loaded: bytes per token and per block (``kvmesh.core.kv_dtype``,
the arithmetic the engine sizes its pool with), blocks and sequences per replica, and replicas for a target
concurrency. Without ``--kv-memory`` the budget follows the engine's rule: ``GPU_KV_FRACTION`` of the device
memory the weights leave (weights estimated from the config; the engine measures what is really free).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from kvmesh.core.engine_config import GPU_KV_FRACTION, EngineConfig
from kvmesh.core.kv_dtype import KV_CACHE_DTYPES, MODEL_DTYPE_BYTES, kv_bytes_per_token, model_dtype_name
from kvmesh.core.model_files import model_config

GIB = 1 << 30
DEFAULT_MODEL_DTYPE = "bfloat16"
"""``auto``'s element type for a config naming none: the engine's dtype on a GPU (``model_loader.default_dtype``)."""
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {f"{unit}i": 1 << (10 * power) for power, unit in enumerate("kmgt", start=1)}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``24GB``, ``512Mi``, ``1.5TB`` or a byte count, in bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]i?)?b?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"cannot parse memory size {text!r}; write e.g. 80GiB, 24GB or a byte count")
    size = int(Fraction(match[1]) * _UNITS[(match[2] or "").lower()])
    if size < 1:
        raise ValueError(f"memory size {text!r} must be positive")
    return size


def _positive_int(config: dict, key: str) -> int:
    value = config.get(key)
    if value is None:
        raise ValueError(f"config has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config {key!r} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelShape:
    """What a model's KV cache and weights depend on, from the language model's part of its config."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    dtype_source: str
    max_position_embeddings: int | None


def text_config(config: dict) -> dict:
    """The language model's config: multimodal configs nest it under ``text_config``."""
    return config.get("text_config") or config


def model_shape(config: dict, dtype: str | None = None) -> ModelShape:
    """Read the KV-relevant shape the way the engine does: no ``num_key_value_heads`` is multi-head attention,
    no ``head_dim`` is ``hidden_size / num_attention_heads``. ``dtype`` overrides the config's."""
    text = text_config(config)
    layers = _positive_int(text, "num_hidden_layers")
    heads = _positive_int(text, "num_attention_heads")
    kv_heads = heads if text.get("num_key_value_heads") is None else _positive_int(text, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(f"config num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if text.get("head_dim") is not None:
        head_dim = _positive_int(text, "head_dim")
    else:
        hidden = _positive_int(text, "hidden_size")
        if hidden % heads:
            raise ValueError(f"config hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        head_dim = hidden // heads
    named = next((c[k] for c in (text, config) for k in ("torch_dtype", "dtype") if c.get(k)), None)
    source = "--dtype" if dtype else "config" if named else "default: the engine's on GPU"
    return ModelShape(
        layers,
        heads,
        kv_heads,
        head_dim,
        model_dtype_name(dtype or named or DEFAULT_MODEL_DTYPE),
        source,
        text.get("max_position_embeddings"),
    )


def estimated_weight_bytes(config: dict, shape: ModelShape) -> int:
    """The weights of a dense Llama-family model with this config, in its dtype: what a replica loads before
    it takes its KV share. Counts every matrix and norm; biases (a rounding error) are left out."""
    text = text_config(config)
    if any((text.get(key) or 0) > 1 for key in _EXPERT_KEYS):
        raise ValueError("cannot estimate a mixture-of-experts model's weights; give the KV budget with --kv-memory")
    hidden, vocab, ffn = (_positive_int(text, key) for key in ("hidden_size", "vocab_size", "intermediate_size"))
    attention = 2 * hidden * shape.head_dim * (shape.num_attention_heads + shape.num_kv_heads)  # q, o, k, v
    mlp = 3 * hidden * ffn  # gate, up, down
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    params = vocab * hidden * (1 if tied else 2) + shape.num_layers * (attention + mlp + 2 * hidden) + hidden
    return params * MODEL_DTYPE_BYTES[shape.dtype]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Workload:
    tokens: float
    """Tokens per sequence (prompt + output) the pool is sized for."""
    blocks: Fraction
    """KV blocks per sequence, a partial last block counting whole (a mean may be fractional)."""
    source: str


def read_lengths(path: Path) -> list[int]:
    """Sequence lengths, one per line, or JSONL records with ``input_length`` + ``output_length`` (Mooncake)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist or is not a file")
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            length = record["input_length"] + record["output_length"] if isinstance(record, dict) else record
        except (json.JSONDecodeError, KeyError, TypeError):
            length = None
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"{path}:{number}: expected a positive length or input_length + output_length")
        lengths.append(length)
    if not lengths:
        raise ValueError(f"{path} holds no lengths")
    return lengths


def workload_from_lengths(lengths: list[int], block_size: int, percentile: float | None, name: str) -> Workload:
    """Size for the mean sequence (default: N sequences hold about N x the mean) or a percentile (nearest rank)."""
    if percentile is None:
        blocks = Fraction(sum(_blocks(n, block_size) for n in lengths), len(lengths))
        return Workload(sum(lengths) / len(lengths), blocks, f"mean of {len(lengths):,} lengths in {name}")
    if not 0 < percentile <= 100:
        raise ValueError(f"--percentile must be in (0, 100], got {percentile}")
    rank = math.ceil(Fraction(str(percentile)) * len(lengths) / 100)  # decimal: p99.9 of 1,000 is 999th, not 1,000th
    tokens = sorted(lengths)[rank - 1]
    source = f"p{percentile:g} of {len(lengths):,} lengths in {name}"
    return Workload(tokens, Fraction(_blocks(tokens, block_size)), source)


def kv_budget(args: argparse.Namespace, config: dict, shape: ModelShape) -> tuple[int, str, dict]:
    """KV bytes per replica, how they were arrived at, and the figures behind them (for ``--json``)."""
    if args.kv_memory is not None:
        if args.memory_fraction is not None:
            raise ValueError("--memory-fraction applies to --device-memory, not --kv-memory")
        budget = parse_bytes(args.kv_memory)
        return budget, "--kv-memory", {}
    fraction = GPU_KV_FRACTION if args.memory_fraction is None else args.memory_fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1], got {fraction}")
    device = parse_bytes(args.device_memory)
    weights = estimated_weight_bytes(config, shape)
    budget = int((device - weights) * fraction)
    if budget < 1:
        raise ValueError(
            f"the weights (~{weights / GIB:.1f} GiB) leave no KV memory in {device / GIB:.1f} GiB of device memory; "
            "a kvmesh replica holds the whole model on one device"
        )
    how = f"{fraction:g} x ({device / GIB:.2f} GiB device - {weights / GIB:.2f} GiB weights, estimated)"
    return budget, how, {"device_memory_bytes": device, "memory_fraction": fraction, "estimated_weight_bytes": weights}


def plan(shape: ModelShape, budget: int, block_size: int, workload: Workload, target: int | None) -> dict[str, dict]:
    """Per KV cache dtype: bytes per token and block, the pool it makes, and the sequences and replicas it serves."""
    rows = {}
    for kv_dtype in KV_CACHE_DTYPES:
        per_token = kv_bytes_per_token(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype, MODEL_DTYPE_BYTES[shape.dtype], block_size
        )
        blocks = budget // (per_token * block_size)
        seqs = int(blocks // workload.blocks)
        rows[kv_dtype] = {
            "bytes_per_token": per_token,
            "bytes_per_block": per_token * block_size,
            "blocks_per_replica": blocks,
            "tokens_per_replica": blocks * block_size,
            "max_concurrent_sequences": seqs,
        }
        if target is not None:
            rows[kv_dtype]["replicas_needed"] = math.ceil(target / seqs) if seqs else None
    return rows


def run(args: argparse.Namespace) -> int:
    """``kvmesh plan``: every error is a ``ValueError``/``FileNotFoundError`` the CLI prints on one line."""
    EngineConfig(block_size=args.block_size)  # the engine's own check of the block size
    for flag, value in (("--context-len", args.context_len), ("--target-concurrency", args.target_concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.percentile is not None and args.lengths is None:
        raise ValueError("--percentile applies to --lengths")
    config = model_config(args.model)
    shape = model_shape(config, args.dtype)
    if args.lengths is not None:
        lengths = read_lengths(Path(args.lengths))
        workload = workload_from_lengths(lengths, args.block_size, args.percentile, args.lengths)
    else:
        workload = Workload(args.context_len, Fraction(_blocks(args.context_len, args.block_size)), "--context-len")
    budget, how, memory = kv_budget(args, config, shape)
    result = {
        "model": args.model,
        "num_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "model_dtype": shape.dtype,
        "model_dtype_source": shape.dtype_source,
        "block_size": args.block_size,
        "kv_budget_bytes": budget,
        "kv_budget_source": how,
        **memory,
        "workload": {
            "source": workload.source,
            "tokens_per_sequence": workload.tokens,
            "blocks_per_sequence": float(workload.blocks),
        },
        "target_concurrency": args.target_concurrency,
        "kv_cache_dtypes": plan(shape, budget, args.block_size, workload, args.target_concurrency),
    }
    print(json.dumps(result, indent=2) if args.json else render(result, shape))
    return 0


def _number(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:,.1f}"


def render(result: dict, shape: ModelShape) -> str:
    """The plan as a short header and one table row per KV cache dtype."""
    work, target, rows = result["workload"], result["target_concurrency"], result["kv_cache_dtypes"]
    lines = [
        f"model      {result['model']}: {shape.num_layers} layers, {shape.num_attention_heads} attention / "
        f"{shape.num_kv_heads} KV heads, head dim {shape.head_dim}, {shape.dtype} ({shape.dtype_source})",
        f"KV budget  {result['kv_budget_bytes'] / GIB:.2f} GiB per replica ({result['kv_budget_source']})",
        f"workload   {_number(work['tokens_per_sequence'])} tokens per sequence ({work['source']}) = "
        f"{_number(work['blocks_per_sequence'])} blocks of {result['block_size']}",
        "",
    ]
    columns = [
        "bytes_per_token",
        "bytes_per_block",
        "blocks_per_replica",
        "tokens_per_replica",
        "max_concurrent_sequences",
    ]
    table = [["kv dtype", "bytes/token", "bytes/block", "blocks/replica", "tokens/replica", "max seqs/replica"]]
    if target is not None:
        table[0].append(f"replicas for {target:,}")
    for kv_dtype, row in rows.items():
        table.append([kv_dtype, *(f"{row[column]:,}" for column in columns)])
        if target is not None:
            table[-1].append(f"{row['replicas_needed']:,}" if row["replicas_needed"] else "does not fit")
    widths = [max(len(cells[i]) for cells in table) for i in range(len(table[0]))]
    for cells in table:  # dtype names left-aligned, numbers right-aligned
        padded = [cell.rjust(width) for cell, width in zip(cells, widths, strict=True)]
        lines.append("  ".join([cells[0].ljust(widths[0]), *padded[1:]]))
    lines += ["", "No prefix sharing assumed: sequences sharing cached prefixes (system prompt, history) fit more."]
    if max(row["max_concurrent_sequences"] for row in rows.values()) > EngineConfig.max_num_seqs:
        lines.append(
            f"A replica runs at most max_num_seqs sequences at once (default {EngineConfig.max_num_seqs}, "
            "kvmesh serve --max-num-seqs): raise it to use the whole pool."
        )
    context = shape.max_position_embeddings
    if context and work["tokens_per_sequence"] > context:
        lines.append(f"The sequences are longer than the model's context ({context:,} tokens).")
    return "\n".join(lines)
