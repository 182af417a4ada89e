"""The ``kvmesh bench`` commands (``kvmesh bench NAME --help``) and what they share: load generation,
workloads, the fleet simulator, the serve process under test, and the results' tables and JSON."""
