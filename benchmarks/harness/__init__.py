"""What benchmarks and tests share: load client, workloads, the fleet simulator, the server under test, reports."""
