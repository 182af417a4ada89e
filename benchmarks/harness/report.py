"""Shared output for benchmarks: the machine they ran on, a printed table, and a JSON file of results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.cluster.monitoring.status import format_table

RESULTS_DIR_ENV = "KVMESH_RESULTS_DIR"


def results_dir() -> Path:
    """Where results go: ``$KVMESH_RESULTS_DIR``, else ``benchmarks/results`` under the working directory (the
    repository's results folder when run from a checkout)."""
    return Path(os.environ.get(RESULTS_DIR_ENV, "benchmarks/results"))


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        return None


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(values: list[float]) -> dict:
    """Per-pair ratios (or any series) as reported: median, range and n."""
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def spread_text(values: list[float]) -> str:
    """``spread`` as a table cell: ``0.42x (0.31-0.55, n=3)``; ``-`` for none."""
    return f"{median(values):.2f}x ({min(values):.2f}-{max(values):.2f}, n={len(values)})" if values else "-"


def _fmt(c) -> str:
    if not isinstance(c, float):
        return str(c)
    return f"{c:.0f}" if abs(c) >= 100 else f"{c:.3g}"


def print_table(headers: list[str], rows: list[list]) -> None:
    print("\n".join(format_table(headers, [[_fmt(c) for c in row] for row in rows], rule=True)))


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[dev]'): no PNG", file=sys.stderr)
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
    """Write ``payload`` (with the machine) to ``path``, by default ``benchmarks/results/<name>.json``."""
    path = path or results_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path
