"""Dependency rules.

- Arrows point one way: server -> jaxserve -> models -> pallas_kernels. A module
  never imports a package of a layer above its own (read from every module's source,
  function-level imports included).
- Host logic imports no JAX: every module of `jaxserve` (and `models.config`) except
  the device-side ones named below, listed from the package so a new module is
  covered without editing this file.
- The runtime never imports torch or transformers.
"""

import ast
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import jaxserve

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("pallas_kernels", "models", "jaxserve", "server")  # bottom to top

# The modules that may import JAX: the compiled step and what builds or drives it.
DEVICE_SIDE = {
    "jaxserve.async_engine",
    "jaxserve.checkpoint",
    "jaxserve.checkpoint.hf",
    "jaxserve.checkpoint.orbax_io",
    "jaxserve.data_parallel",
    "jaxserve.engine.core",  # LLMEngine builds the model runner
    "jaxserve.engine.startup",  # sets JAX's compilation cache; warms up
    "jaxserve.llm",
    "jaxserve.multihost",
    "jaxserve.parallel",
    "jaxserve.preflight",  # builds the engine for a compile-only target
    "jaxserve.ray_replicas",  # its actors build and drive an LLMEngine
    "jaxserve.runner.bundle",  # serializes and loads compiled programs
    "jaxserve.runner.draft",
    "jaxserve.runner.kv_io",
    "jaxserve.runner.model_runner",
    "jaxserve.runner.sampler",
    "jaxserve.runner.step",
    "jaxserve.targets",  # compile-only devices of TPUs and GPUs
}
JAXSERVE_MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxserve.__path__, "jaxserve."))
HOST_MODULES = [m for m in JAXSERVE_MODULES if m not in DEVICE_SIDE] + ["models.config"]


def _imports(path: pathlib.Path) -> set[str]:
    """Top-level package names a source file imports (absolute imports, any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imports_point_down_the_layers():
    upward = []
    for rank, layer in enumerate(LAYERS):
        for path in sorted((ROOT / layer).rglob("*.py")):
            above = _imports(path) & set(LAYERS[rank + 1 :])
            if above:
                upward.append(f"{path.relative_to(ROOT)} imports {sorted(above)}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from server.app import JaxServeServer\n")
    assert _imports(bad) == {"server"}


def test_device_side_list_names_real_modules():
    assert set(DEVICE_SIDE) <= set(JAXSERVE_MODULES)
    assert "jaxserve.scheduler" in HOST_MODULES and "jaxserve.sequence" in HOST_MODULES
    # Structured output's grammar layer is host logic (the bitmask is the sampler's input).
    assert {"jaxserve.structured", "jaxserve.structured.compiler"} <= set(HOST_MODULES)
    # So are speculative decoding's proposers (the draft model's runner is device side).
    assert {"jaxserve.spec", "jaxserve.spec.ngram"} <= set(HOST_MODULES)


def _imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return {m.split(".")[0] for m in proc.stdout.split()}


def test_runtime_never_imports_torch_or_transformers():
    mods = _imported_after(
        "import jaxserve, jaxserve.engine, jaxserve.structured, server.cli.generate, server.app, "
        "models, pallas_kernels\nmodels.supported_architectures()"
    )
    assert not mods & {"torch", "transformers"}


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_logic_imports_no_jax(module):
    assert "jax" not in _imported_after(f"import {module}")
