"""Regenerate the gRPC stubs from ``kvmesh.proto``: ``python -m kvmesh.cluster.proto.build [--out DIR]``.

The stubs are committed (users need no protoc); ``grpcio-tools`` is pinned in the ``test`` extra and a test
regenerates them and compares, so the committed files always match the ``.proto``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "kvmesh/cluster/proto/kvmesh.proto"


def build(out: Path = ROOT) -> None:
    from grpc_tools import protoc

    code = protoc.main(["protoc", f"-I{ROOT}", f"--python_out={out}", f"--grpc_python_out={out}", str(ROOT / PROTO)])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write kvmesh/cluster/proto/*_pb2*.py under")
    build(parser.parse_args().out)
    sys.exit(0)
