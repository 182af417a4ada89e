"""What the ingress and the engine replicas share, free of torch: the ingress imports only this of the
engine's side (block hashing, the messages between processes, sampling parameters, limits, errors, model
files and tokenizers)."""
