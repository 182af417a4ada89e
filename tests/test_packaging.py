"""What ``pip install .`` puts on a user's machine: one ``kvmesh`` namespace, built from the design card's top-level
folders (``router/`` is ``kvmesh.router``, and so on), and the ``kvmesh`` command."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.source_tree import PACKAGE_DIRS, ROOT, SETUPTOOLS, modules, packages


def test_every_source_package_is_listed_for_the_wheel():
    """A sub-package missing from pyproject's ``packages`` would be left out of the wheel (and of a user's
    install) while every test in the repository still imports it."""
    assert sorted(SETUPTOOLS["packages"]) == sorted(packages())
    assert set(PACKAGE_DIRS) == {"kvmesh.core", "kvmesh.router", "kvmesh.replica", "kvmesh.kernels"} | {
        "kvmesh.cluster",
        "kvmesh.bench",
    }
    assert {folder.name for folder in PACKAGE_DIRS.values()} == {
        "core",
        "router",
        "replica",
        "kernels",
        "cluster",
        "benchmarks",
    }


def test_the_wheel_installs_only_the_kvmesh_package_and_its_command(tmp_path):
    source = tmp_path / "src"  # a copy: setuptools writes build/ beside the sources
    skip = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "results", ".*cache", ".gpu")
    shutil.copytree(ROOT, source, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("kvmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvmesh"}, f"top-level entries besides kvmesh: {sorted(top - {'kvmesh'})}"
    for data in (
        "kvmesh/router/lua/",
        "kvmesh/kernels/csrc/paged_cache.h",
        "kvmesh/cluster/ingress/proto/kvmesh.proto",
    ):
        assert any(n.startswith(data) for n in names), f"{data} is missing from the wheel"
    assert not any(n.startswith(("kvmesh/bench/results", "kvmesh/bench/workloads")) for n in names)
    # Each module comes from its folder: kvmesh/router/policy.py is router/policy.py, and so on.
    with zipfile.ZipFile(wheel) as archive:
        for module, path in modules():
            member = module.replace(".", "/") + ("/__init__.py" if path.stem == "__init__" else ".py")
            assert archive.read(member) == path.read_bytes(), f"{member} is not {path.relative_to(ROOT)}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvmesh = kvmesh.cluster.launch.cli:main" in text

    # Installed into a fresh virtualenv (its dependencies seen from this environment): one package, the
    # command, and the command runs from the installed copy.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    (site,) = venv.glob("lib/python*/site-packages")
    assert {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")} == {"kvmesh"}
    where = subprocess.run(
        [python, "-c", "import kvmesh.cluster.launch.cli as cli; print(cli.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert Path(where.stdout.strip()).is_relative_to(site)
    help_text = subprocess.run([venv / "bin" / "kvmesh", "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "serve" in help_text.stdout


OPTIONAL_IMPORTS = {
    "triton": "GPU kernels: CUDA builds of torch bring it; imported only where a kernel is built",
    "matplotlib": "benchmark pictures (the dev extra); without it benchmarks write no PNG",
    "grpc_tools": "regenerates the gRPC stubs (the test extra); not run by users",
    "vllm": "kvmesh bench engine_overhead runs harness/vllm_side.py in vLLM's own virtualenv, never ours",
    "llguidance": "kvmesh bench grammar_backends times the grammar libraries a user could pick, where installed",
    "outlines_core": "kvmesh bench grammar_backends, as llguidance",
    "nixl": "kvmesh bench kv_transport runs harness/kv_transport_nixl.py in NIXL's own virtualenv, never ours",
}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_library_the_package_imports_is_a_declared_dependency():
    """A fresh ``pip install .`` must bring everything ``kvmesh`` imports: a library that only arrives through
    the test extra, or through another package's dependencies, breaks ``kvmesh serve`` on a user's machine the
    day that package stops bringing it (httpx once came only with the test extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalized(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in project["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    imported: dict[str, str] = {}
    for _, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "kvmesh" and top not in OPTIONAL_IMPORTS:
                    imported.setdefault(top, str(path.relative_to(ROOT)))
    undeclared = {
        module: where
        for module, where in imported.items()
        if not declared & {_normalized(d) for d in providers.get(module, [module])}
    }
    assert "httpx" in imported and "aiohttp" in imported  # the walk sees the package's imports
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
