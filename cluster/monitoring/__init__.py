"""What a cluster shows of itself: Prometheus metrics and the status behind kvmesh status."""
