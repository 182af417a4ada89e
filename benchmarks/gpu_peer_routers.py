"""``kvmesh bench peer_routers`` on GPU engines, for a GPU machine the real weights cannot reach.

    kvmesh bench gpu_peer_routers OUT --tokenizer DIR --smg SMG [--shape llama8b] [peer_routers options]
    kvmesh bench gpu_peer_routers OUT --tokenizer DIR --smg SMG --smoke   # CPU, a toy model

Writes random weights in a real model's shape with SmolLM2's tokenizer (``--tokenizer``: a directory of its
files; ``llama8b``: Llama-3-8B's layers over SmolLM2's vocabulary, so prefills cost what users' do;
``smollm2``: SmolLM2-135M's), then runs the kvmesh engines on CUDA, all on the one GPU, each with its own KV
pool (8 GiB: 65k tokens of the 8B shape, more than a run fills, so no host tier), behind kvmesh's router and
the peers: routers and the load client get the host's cores to themselves.
Random weights change no router's work: the benchmark times first tokens and reads the engines' own cache hits.
Writes ``OUT/peer_routers_gpu.json``; progress on stderr. A second run on the machine reuses the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmesh.bench.harness.model_shapes import LLAMA3_8B_SHAPE, Scale, llama_shaped, random_model, smollm2_config

SMOKE_LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench gpu_peer_routers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory with SmolLM2's tokenizer files")
    ap.add_argument("--shape", choices=("llama8b", "smollm2"), default="llama8b")
    ap.add_argument("--kv-cache-gib", type=float, default=8.0, help="each engine's KV pool on the GPU")
    ap.add_argument("--smoke", action="store_true", help="on the CPU with a 2-layer model: the script end to end")
    args, rest = ap.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        config, dtype = smollm2_config(Scale(layers=SMOKE_LAYERS)), "float32"
        engine_args = "--device cpu --num-kv-blocks 512"
    else:
        llama8b = llama_shaped(LLAMA3_8B_SHAPE, tied=False, rope_theta=500000.0)
        config = llama8b if args.shape == "llama8b" else smollm2_config(Scale())
        dtype, engine_args = "bfloat16", f"--device cuda --kv-cache-gib {args.kv_cache_gib:g} --host-cache-gib 0"
    model = random_model("smoke" if args.smoke else args.shape, config, args.tokenizer, dtype)
    from kvmesh.cluster.launch.cli import main as kvmesh_main  # the benchmark itself, as `kvmesh bench peer_routers`

    own = ["--model", str(model), "--engine-args", engine_args, "--json", str(args.out / "peer_routers_gpu.json")]
    rc = kvmesh_main(["bench", "peer_routers", *rest, *own])
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
