"""kvmesh: a multi-replica LLM serving cluster with KV-aware routing.

``kvmesh.shared`` holds the torch-free pieces the ingress and the engine replicas both use (block hashing,
the messages between processes, sampling parameters, limits, errors, model files); ``kvmesh.router`` the
index and routing; ``kvmesh.replica`` and ``kvmesh.kernels`` the engine; ``kvmesh.cluster`` the service;
``kvmesh.bench`` the ``kvmesh bench`` commands. ``docs/architecture.md`` is the map.
"""
