"""kvmesh's engines as a service: EngineReplica, its deployment and router settings, kvmesh engine, autoscaling."""
