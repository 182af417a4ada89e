"""Regenerate the gRPC stubs from ``kvmesh.proto``: ``python -m kvmesh.cluster.ingress.proto.build [--out DIR]``.

The stubs are committed (users need no protoc); ``grpcio-tools`` is pinned in the ``test`` extra and a test
regenerates them and compares, so the committed files always match the ``.proto``. protoc names modules by the
proto's path under its include root, so the proto is compiled from a temporary tree laid out as the import
path (``kvmesh/cluster/ingress/proto/``): the stubs then import ``kvmesh.cluster.ingress.proto``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "kvmesh/cluster/ingress/proto/kvmesh.proto"
STUBS = ("kvmesh_pb2.py", "kvmesh_pb2_grpc.py")


def build(out: Path = HERE) -> None:
    """Write the stubs into ``out`` (default: beside this file)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / PROTO).parent.mkdir(parents=True)
        shutil.copy(HERE / "kvmesh.proto", root / PROTO)
        code = protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}", PROTO])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out.mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            shutil.copy((root / PROTO).parent / name, out / name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write kvmesh_pb2*.py into")
    build(parser.parse_args().out)
    sys.exit(0)
