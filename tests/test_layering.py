"""The packages depend one way, as docs/architecture.md's table says: checked on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KVMESH = Path(__file__).resolve().parents[1] / "kvmesh"
ALLOWED = {
    "shared": {"shared"},
    "kernels": {"kernels"},
    "router": {"router", "shared"},
    "replica": {"replica", "kernels", "shared", "router.prefix_lru", "router.sessions"},
}
"""What each package may import of kvmesh (a package, or one module of it)."""
TORCH_FREE = {"shared", "router"}


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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_what_the_layering_allows(package):
    wrong = []
    for path in (KVMESH / package).rglob("*.py"):
        for name, top_level in module_imports(path):
            if name.startswith("kvmesh."):
                target = name.removeprefix("kvmesh.")
                if not any(target == a or target.startswith(a + ".") for a in ALLOWED[package]):
                    wrong.append(f"{path.relative_to(KVMESH)} imports {name}")
            elif package in TORCH_FREE and top_level and name.split(".")[0] in ("torch", "triton"):
                wrong.append(f"{path.relative_to(KVMESH)} imports {name} at module level")
    assert not wrong, wrong
