"""What ``pip install .`` puts on a user's machine: one ``kvmesh`` namespace and the ``kvmesh`` command."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    for data in ("kvmesh/router/lua/", "kvmesh/kernels/csrc/", "kvmesh/cluster/proto/kvmesh.proto"):
        assert any(n.startswith(data) for n in names), f"{data} is missing from the wheel"
    assert not any(n.startswith("kvmesh/bench/results") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvmesh = kvmesh.cluster.cli:main" in text
