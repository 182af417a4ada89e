"""Benchmarks: each module runs with ``python -m benchmarks.<name>``, prints a table, writes JSON."""
