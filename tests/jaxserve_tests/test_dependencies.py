"""Dependency rules.

- Arrows point one way: server -> jaxserve -> models -> pallas_kernels. A module
  never imports a package of a layer above its own (read from every module's source,
  function-level imports included).
- Host logic imports no JAX: every module of `jaxserve` (and `models.config`) except
  the device-side ones named below, listed from the package so a new module is
  covered without editing this file.
- The runtime never imports torch or transformers.
- No import cycle among the modules of the four packages, read from the source:
  every import counts, function-level ones included, except those under
  `if TYPE_CHECKING:` (never run) and the few function-level imports named in
  DEFERRED, which the code relies on to stay acyclic.
"""

import ast
import json
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
    "jaxserve.checkpoint.quantized",  # 4-bit checkpoints' Int4Linears
    "jaxserve.compile_records",  # compiles for compile-only devices
    "jaxserve.controls",  # the engine's side of each control (pause and sleep checks)
    "jaxserve.distributed.data_parallel",
    "jaxserve.engine.core",  # LLMEngine builds the model runner
    "jaxserve.engine.lifecycle",  # sleep and wake-up free and allocate device buffers
    "jaxserve.engine.profiling",  # JAX's profiler
    "jaxserve.engine.startup",  # sets JAX's compilation cache; warms up
    "jaxserve.llm",
    "jaxserve.distributed.multihost",
    "jaxserve.distributed.meshes",
    "jaxserve.preflight",  # builds the engine for a compile-only target
    "jaxserve.distributed.ray_replicas",  # its actors build and drive an LLMEngine
    "jaxserve.distributed.ray_actor",  # (those actors)
    "jaxserve.runner.bundle",  # serializes and loads compiled programs
    "jaxserve.runner.compile_counter",  # JAX's monitoring listeners
    "jaxserve.runner.draft",
    "jaxserve.runner.kv_io",
    "jaxserve.runner.kv_plan",  # the KV arrays per layer group
    "jaxserve.runner.lora_io",  # the LoRA matrices' placement and slot write
    "jaxserve.runner.model_runner",
    "jaxserve.runner.packing",  # a step's arrays in one buffer (unpacked in the program)
    "jaxserve.runner.residency",  # device buffers deleted and allocated again (sleep)
    "jaxserve.runner.sampler",
    "jaxserve.runner.step",
    "jaxserve.runner.warmup",
    "jaxserve.runner.weight_update",
    "jaxserve.targets",  # compile-only devices of TPUs and GPUs
    "jaxserve.training",  # the served model's differentiable forward (RL loops)
}
# Function-level imports that close a cycle, (importer, imported): each runs after
# both modules have loaded. No other import may close one.
DEFERRED = {
    # A package's `__getattr__` loads its device side on first use, so that its host
    # modules import no JAX (they import the package first). (`jaxserve.engine`'s
    # does too, and closes no cycle while jaxserve's is deferred.)
    ("jaxserve", "jaxserve.llm"): "jaxserve.LLM",
    ("models", "models.registry"): "models.get_model_class and the registry",
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


# One process imports nothing but the standard library's os, sys and json, then forks a
# child per module: each child imports its module into a fresh interpreter state (the
# parent's, as it was) and reports the top-level packages loaded. One interpreter start
# instead of one per module, and each import still alone.
EACH_ALONE = """
import json, os, sys
out = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(module)
            loaded = sorted({m.split(".")[0] for m in sys.modules})
        except BaseException as e:
            loaded = f"{type(e).__name__}: {e}"
        os.write(write, json.dumps(loaded).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out[module] = json.loads(f.read() or '"no report"')
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def host_imports() -> dict[str, list[str] | str]:
    """Each host module -> the top-level packages importing it alone loads (or the
    error it raised)."""
    proc = subprocess.run(
        [sys.executable, "-c", EACH_ALONE, *HOST_MODULES],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(proc.stdout)


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_logic_imports_no_jax(host_imports, module):
    loaded = host_imports[module]
    assert isinstance(loaded, list), f"import {module} failed: {loaded}"
    assert "jax" not in loaded


def test_the_jax_check_sees_a_module_that_imports_jax():
    proc = subprocess.run(
        [sys.executable, "-c", EACH_ALONE, "jaxserve.targets", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    loaded = json.loads(proc.stdout)
    assert "jax" in loaded["jaxserve.targets"] and "jax" not in loaded["json"]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_imports(name: str, source: str) -> list[tuple[str, bool]]:
    """(imported module, inside a function?) for each import of the packages' modules
    in `source`, the code of module `name`; `from p import m` names p.m if it is a
    module. Imports under `if TYPE_CHECKING:` are left out."""
    found: list[tuple[str, bool]] = []
    package = name if SOURCES.get(name, ROOT).name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for stmt in child.orelse:  # (the else branch runs)
                    visit_one(stmt, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in SOURCES else base, in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        visit(node, inner)

    visit(ast.parse(source), False)
    return [(module, f) for module, f in found if module in SOURCES]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the path that closes it (first node repeated), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _import_graph(deferred) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """The packages' import graph without the `deferred` function-level imports, and
    the function-level imports seen (importer, imported)."""
    graph: dict[str, set[str]] = {}
    in_functions = set()
    for name, path in SOURCES.items():
        graph[name] = set()
        for module, in_function in _module_imports(name, path.read_text()):
            if in_function:
                in_functions.add((name, module))
            if not (in_function and (name, module) in deferred):
                graph[name].add(module)
    return graph, in_functions


def test_no_import_cycle():
    graph, in_functions = _import_graph(DEFERRED)
    cycle = _find_cycle(graph)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle)
    # Each deferred import is still one, inside a function (at the top it closes a cycle),
    # and still needed: without it, there is a cycle (else drop it from DEFERRED).
    assert set(DEFERRED) <= in_functions, sorted(set(DEFERRED) - in_functions)
    for edge in DEFERRED:
        graph, _ = _import_graph(set(DEFERRED) - {edge})
        assert _find_cycle(graph) is not None, f"{edge} closes no cycle: drop it from DEFERRED"


def test_the_cycle_check_sees_a_cycle():
    assert _module_imports("jaxserve.scheduler", "import jaxserve.sequence\n") == [
        ("jaxserve.sequence", False)
    ]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jaxserve.kv\n"
    assert _module_imports("jaxserve.scheduler", source) == []
    deferred = "def f():\n    from jaxserve.engine import core\n"
    assert _module_imports("jaxserve.kv.pool", deferred) == [("jaxserve.engine.core", True)]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
