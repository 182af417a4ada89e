"""The front door: HTTP and gRPC, admission, generation (tokenize and hash once, stream), the ingress deployment."""
