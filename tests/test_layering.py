"""The packages depend one way, as docs/architecture.md's table says: every package and sub-package has a
row, and every module's imports are checked against its package's row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.source_tree import ROOT, modules, packages

ROW = re.compile(r"^\| `(kvmesh[\w.]*)` \| `([\w/]+)` \|.*\| (.+) \| (yes|no) \|$", re.M)


def layering_table() -> dict[str, tuple[str, set[str], bool]]:
    """package -> (folder, what it may import of kvmesh, whether torch is allowed at module level)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    return {
        package: (folder.rstrip("/"), set(re.findall(r"`(kvmesh[\w.]*)`", may)), torch == "yes")
        for package, folder, may, torch in ROW.findall(text)
    }


TABLE = layering_table()


def module_imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [(name, id(node) in top) for name in names]
    return found


def covers(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def test_every_package_and_sub_package_has_a_row_in_the_map():
    real = {name: path.relative_to(ROOT).as_posix() for name, path in packages().items()}
    assert real == {package: folder for package, (folder, _, _) in TABLE.items()}


@pytest.mark.parametrize("package", sorted(TABLE))
def test_each_package_imports_only_what_the_map_allows(package):
    _, allowed, torch_ok = TABLE[package]
    wrong = []
    for module, path in modules():
        owner = max((p for p in TABLE if covers(module, {p})), key=len)
        if owner != package:
            continue
        for name, top_level in module_imports(path):
            if name.startswith("kvmesh.") and not covers(name, allowed | {package}):
                wrong.append(f"{module} imports {name}")
            elif not torch_ok and top_level and name.split(".")[0] in ("torch", "triton"):
                wrong.append(f"{module} imports {name} at module level")
    assert not wrong, wrong


def test_the_map_is_not_vacuous():
    """The checks above would pass on an empty table: the rows must be read, and a forbidden import seen."""
    assert {"kvmesh.core", "kvmesh.router", "kvmesh.replica", "kvmesh.cluster.ingress"} <= set(TABLE)
    assert not covers("kvmesh.replica.engine", TABLE["kvmesh.cluster.ingress"][1])
    assert covers("kvmesh.router.prefix_lru", TABLE["kvmesh.replica"][1])
