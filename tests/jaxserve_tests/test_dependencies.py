"""Dependency rules: the runtime never imports torch/transformers; host logic imports no JAX."""

import subprocess
import sys

import pytest


def _imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return {m.split(".")[0] for m in proc.stdout.split()}


def test_runtime_never_imports_torch_or_transformers():
    mods = _imported_after(
        "import jaxserve, jaxserve.engine, server.cli.generate, models, "
        "pallas_kernels\nmodels.supported_architectures()"
    )
    assert not mods & {"torch", "transformers"}


@pytest.mark.parametrize(
    "module",
    [
        "jaxserve.config",
        "jaxserve.kv",
        "jaxserve.sampling_params",
        "jaxserve.runner.input_batch",
        "jaxserve.outputs",
    ],
)
def test_host_logic_imports_no_jax(module):
    assert "jax" not in _imported_after(f"import {module}")
