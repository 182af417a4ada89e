"""The kvmesh command: CLI, configuration, kvmesh serve's launcher and Serve application, embedded Redis, plan."""
