"""Every benchmark, as ``kvmesh bench NAME``: the module ``benchmarks/NAME.py`` (``kvmesh.bench.NAME``) is the
command NAME; it prints a table and writes JSON. What several benchmarks share (load client, workloads, the
fleet simulator, the server under test, the report) is in ``harness/``; recorded results in ``results/``."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

NOT_COMMANDS = {"harness"}


def commands() -> list[str]:
    """The benchmark names, from the modules beside this one (none is imported)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_COMMANDS)


def command(name: str) -> ModuleType:
    """Benchmark ``name``'s module; its ``main(argv)`` runs it."""
    if name not in commands():
        raise ValueError(f"no benchmark {name!r}: one of {', '.join(commands())}")
    return importlib.import_module(f"{__name__}.{name}")
