"""Stream a chat completion from a running ``kvmesh serve`` over gRPC, then ask for one whole reply.

python examples/grpc_client.py [--target localhost:9000] [--api-key KEY] "Why is the sky blue?"
"""

from __future__ import annotations

import argparse
import os

import grpc

from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="Why is the sky blue?")
    parser.add_argument("--target", default="localhost:9000")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"), help="if the cluster requires one")
    args = parser.parse_args()
    request = kvmesh_pb2.GenerateRequest(
        messages=[kvmesh_pb2.ChatMessage(role="user", content=args.prompt)], max_tokens=args.max_tokens, temperature=0
    )
    # Ray Serve's gRPC proxy picks the application from this metadata (optional while only one is deployed).
    metadata = (("application", "kvmesh"),)
    if args.api_key:
        metadata += (("authorization", f"Bearer {args.api_key}"),)
    with grpc.insecure_channel(args.target) as channel:
        stub = kvmesh_pb2_grpc.KVMeshStub(channel)
        for chunk in stub.Generate(request, metadata=metadata):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                u = chunk.usage
                print(
                    f"\n[{chunk.finish_reason}: {u.prompt_tokens} prompt ({u.cached_tokens} cached), "
                    f"{u.completion_tokens} generated]"
                )
        whole = stub.Complete(request, metadata=metadata)
        print(f"unary Complete: {whole.text!r} ({whole.finish_reason})")


if __name__ == "__main__":
    main()
