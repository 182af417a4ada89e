"""The kvmesh namespace's source folders, read from pyproject.toml's ``package-dir`` (their one definition)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, Path] = {name: ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items()}
"""``kvmesh.router`` -> ``ROOT/router``, and so on."""
NOT_SOURCE = {"results", "workloads", "__pycache__"}
"""Folders inside a source folder that hold data, not code."""


def packages() -> dict[str, Path]:
    """Every package and sub-package (a folder with ``__init__.py``) under the source folders, by name."""
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if not NOT_SOURCE & set(rel.parts):
                found[".".join([name, *rel.parts])] = init.parent
    return found


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every Python file of the namespace."""
    for name, folder in packages().items():
        for path in sorted(folder.glob("*.py")):
            yield (name if path.stem == "__init__" else f"{name}.{path.stem}"), path
