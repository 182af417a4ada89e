"""Runs ``vllm_side.py`` under the python of vLLM's own virtualenv (never a kvmesh dependency) and reads its
answer: the kvmesh side of an offline side-by-side against vLLM's CPU build."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

VLLM_SIDE = Path(__file__).with_name("vllm_side.py")


def vllm_tok_s(
    python: str,
    model: Path,
    work: list[list[int]],
    olens: list[int],
    sampling: bool,
    threads: int,
    dtype: str,
    **extra,
) -> float:
    """Output tokens per second of vLLM's ``LLM.generate`` over ``work`` (``extra``: ``loras`` and
    ``max_lora_rank``, as ``vllm_side.py`` reads them)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        job = {"prompts": work, "output_lens": olens, "sampled": sampling, "threads": threads, "dtype": dtype}
        json.dump({**job, **extra}, f)
    out = subprocess.run(
        [python, str(VLLM_SIDE), str(model), f.name], capture_output=True, text=True, timeout=3600, cwd="/tmp"
    )
    Path(f.name).unlink(missing_ok=True)
    if out.returncode != 0:
        raise RuntimeError(f"vLLM run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"tok_per_s"'))
    return json.loads(result)["tok_per_s"]
