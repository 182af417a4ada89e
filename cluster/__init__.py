"""What makes kvmesh a service, one concern per sub-package (docs/architecture.md says which imports which)."""
