"""Imports run one way: server -> engine -> (core | worker) -> models -> pallas_kernels, with
loaders, sharding rules and sampling beside, and nothing pointing back up. Read from the source
(every import statement, also those inside functions), so it needs nothing installed."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEAVES = ("jaxllm.config", "jaxllm.outputs", "jaxllm.sampling_params", "jaxllm.pooling_params",
          "jaxllm.sharding.axes", "jaxllm.lora.request")

# package -> the project packages it may import (itself and the leaves always).
ALLOWED = {
    "pallas_kernels": (),
    "jaxllm.models": ("pallas_kernels",),
    "jaxllm.sample": (),
    "jaxllm.detok": (),
    "jaxllm.core": (),
    "jaxllm.spec_decode": (),
    "jaxllm.loader": ("jaxllm.models",),
    "jaxllm.sharding": ("jaxllm.models",),
    "jaxllm.lora": ("jaxllm.models",),
    "jaxllm.worker": ("jaxllm.core.scheduler", "jaxllm.core.dp_scheduler",
                      "jaxllm.core.pooling_scheduler", "jaxllm.models",
                      "jaxllm.sample", "jaxllm.lora", "pallas_kernels"),
    "jaxllm.engine": ("jaxllm.core", "jaxllm.worker", "jaxllm.models", "jaxllm.loader",
                      "jaxllm.sharding", "jaxllm.sample", "jaxllm.detok", "jaxllm.spec_decode",
                      "jaxllm.lora", "pallas_kernels"),
    "jaxllm.server": ("jaxllm.engine", "jaxllm.detok"),
}
# Entry points above everything: the CLI and the benchmarks may import any layer.
TOP = ("jaxllm.cli", "jaxllm.bench", "jaxllm.server.__main__", "jaxllm.server.testing",
       "jaxllm.__init__")
PROJECT = ("jaxllm", "pallas_kernels")


def _module_files():
    """(module name, path) of every project module; server/ and sharding/ under their installed
    names jaxllm.server and jaxllm.sharding."""
    folders = {"jaxllm": "jaxllm", "pallas_kernels": "pallas_kernels",
               "server": "jaxllm.server", "sharding": "jaxllm.sharding"}
    for folder, package in folders.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d not in ("server", "sharding", "__pycache__")]
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in filenames:
                if name.endswith(".py"):
                    yield f"{prefix}.{name[:-3]}", os.path.join(dirpath, name)


def imported_modules(source: str, module: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.rsplit(".", node.level)[0]
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(module: str, source: str) -> list[str]:
    """The imports of `module` that point against the layering."""
    if _within(module, TOP):
        return []
    layer = next((p for p in sorted(ALLOWED, key=len, reverse=True) if _within(module, [p])),
                 None)
    if layer is None:  # a leaf (config, outputs, sampling_params): imports nothing above it
        allowed = LEAVES
    else:
        allowed = (layer, *ALLOWED[layer], *LEAVES)
    bad = []
    for name in sorted(imported_modules(source, module)):
        if not _within(name, PROJECT) or name in PROJECT:
            continue
        if not _within(name, allowed) and not any(_within(a, [name]) for a in allowed):
            bad.append(f"{module} imports {name}")
    return bad


def test_imports_run_one_way():
    found = []
    for module, path in _module_files():
        with open(path) as f:
            found += violations(module, f.read())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, source", [
    ("jaxllm.models.transformer", "from jaxllm.worker.batch import build_step_batch"),
    ("jaxllm.core.scheduler", "def f():\n    from jaxllm.engine import llm"),
    ("pallas_kernels.kv_write", "import jaxllm.models"),
    ("jaxllm.engine.llm", "from jaxllm.server import app"),
    ("jaxllm.sharding.rules", "from jaxllm.engine.model_setup import load_for_engine"),
])
def test_a_back_pointing_import_is_caught(module, source):
    assert violations(module, source)


def test_the_wheel_installs_no_top_level_server_or_sharding(tmp_path):
    """server/ and sharding/ install as jaxllm.server and jaxllm.sharding only: the built wheel
    holds no top-level server or sharding package."""
    import shutil
    import subprocess
    import sys
    import zipfile
    source = tmp_path / "src"  # a copy: building writes build/ and egg-info beside the sources
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".old", ".whl", ".gpu", "__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(source), "-w", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("jaxllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"jaxllm", "pallas_kernels",
                                                 wheel.name.split("-py3")[0] + ".dist-info"}
    assert "jaxllm/server/app.py" in names and "jaxllm/sharding/rules.py" in names
