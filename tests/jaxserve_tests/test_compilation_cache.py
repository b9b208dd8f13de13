"""The persistent compilation cache: a second start loads every step program, from
files that processes share without a lock (`jaxserve.compile_cache`, whose tests show
that a reader never sees half an entry). It is JAX's, process-wide: the command line
and `LLM()` set it (the default directory, unless the process set one; None: none),
constructing an engine never does."""

import os

import pytest
from cache_dir import python_with_its_own_cache as _python

SNIPPET = """
import sys
from jaxserve import LLM
llm = LLM("demo-model-tiny", max_num_seqs=4, max_num_batched_tokens=64,
          compilation_cache_dir=sys.argv[1])
c = llm.engine.runner.compiles
print("built", c.count, "from_cache", c.cache_hits)
"""


def _start(cache_dir):
    line = next(x for x in _python(SNIPPET, cache_dir) if x.startswith("built"))
    _, built, _, hits = line.split()
    return int(built), int(hits)


@pytest.mark.slow
def test_a_second_start_loads_every_program_from_the_cache(tmp_path):
    built, hits = _start(tmp_path)
    assert built > 0 and hits == 0
    again, hits = _start(tmp_path)
    assert again == built and hits == built  # every program came from the cache
    assert ".lockfile" not in os.listdir(tmp_path)  # (JAX's own cache's lock)


# Each line prints JAX's cache directory after one way of building an engine.
WHO_SETS_IT = """
import dataclasses, sys
import jax
from absl import flags
from jaxserve import LLM
from jaxserve.engine import LLMEngine
from jaxserve.llm import DEFAULT_COMPILATION_CACHE
from server.cli import engine_flags

small = dict(warmup=False, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32)
with LLM("demo-model-tiny", compilation_cache_dir=None, **small) as llm:
    config = llm.config
print("LLM(compilation_cache_dir=None)", jax.config.jax_compilation_cache_dir)
# A config that names a directory does not make an engine set it either.
with LLMEngine(dataclasses.replace(config, compilation_cache_dir=sys.argv[1])):
    pass
print("LLMEngine", jax.config.jax_compilation_cache_dir)
print("flag default", flags.FLAGS["compilation_cache_dir"].default == DEFAULT_COMPILATION_CACHE)
flags.FLAGS(["jaxserve", "--compilation_cache_dir=" + sys.argv[1]])
with LLM("demo-model-tiny", **{**engine_flags.engine_kwargs(), **small}):
    pass
print("command line", jax.config.jax_compilation_cache_dir)
"""

# A new process's LLM() uses the default cache; one the process set first is kept.
LLM_DEFAULT = """
import sys
import jax
from jaxserve import LLM
from jaxserve.llm import DEFAULT_COMPILATION_CACHE

small = dict(warmup=False, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=32)
if sys.argv[1] != "-":
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
with LLM("demo-model-tiny", **small):
    pass
got = jax.config.jax_compilation_cache_dir
print("LLM()", "the default" if got == DEFAULT_COMPILATION_CACHE else got)
"""


@pytest.mark.slow
def test_the_command_line_and_llm_set_the_cache_and_an_engine_never_does(tmp_path):
    assert _python(WHO_SETS_IT, tmp_path)[-4:] == [
        "LLM(compilation_cache_dir=None) None",
        "LLMEngine None",
        "flag default True",
        f"command line {tmp_path}",
    ]
    # (LLM() in a new process: ~82 s of compiling the demo model, 9 s from the cache.)
    assert _python(LLM_DEFAULT, "-")[-1] == "LLM() the default"
    assert _python(LLM_DEFAULT, tmp_path)[-1] == f"LLM() {tmp_path}"  # the process's kept


# A Pallas kernel compiled for a compile-only TPU and GPU four times: as it is, again,
# the same code three lines lower in another file, and with its source changed (one
# constant). Each line: the target, whether a record answered, how many programs XLA
# built, and the flops XLA:TPU read from the kernel.
KERNEL_CHANGE = """
import functools, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxserve.compile_records import CompiledRecord, compile_for
from jaxserve.engine.startup import use_compilation_cache
from jaxserve.runner.compile_counter import CompileCounter
from jaxserve.targets import Target, compiling_for

use_compilation_cache(sys.argv[1])
counter = CompileCounter()

KERNEL = '''
def kernel(scale, x_ref, o_ref):
    o_ref[...] = x_ref[...] * scale
'''

def defined(lines_above, file):
    scope = {}
    exec(compile("\\n" * lines_above + KERNEL, file, "exec"), scope)
    return scope["kernel"]

def program(target, scale, kernel):
    dev = Target.parse(target).devices()[0]
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(dev))
    kw = {}
    if dev.platform == "tpu":  # the kernel's declared cost says which source compiled
        kw["cost_estimate"] = pl.CostEstimate(flops=int(scale), bytes_accessed=1, transcendentals=0)
    else:
        kw["compiler_params"] = plgpu.CompilerParams(num_warps=4)
    call = pl.pallas_call(functools.partial(kernel, scale), out_shape=x, **kw)
    with compiling_for(dev):
        return compile_for(jax.jit(call).lower(x), [dev])

here, moved = defined(0, "/a/kernels.py"), defined(3, "/b/kernels.py")
for target in ("v5e", "h100"):
    for scale, kernel in ((1000.0, here), (1000.0, here), (1000.0, moved), (3000.0, here)):
        before = counter.count
        compiled = program(target, scale, kernel)
        cost = compiled.cost_analysis()
        flops = int(cost["flops"]) if cost else None
        print(target, isinstance(compiled, CompiledRecord), counter.count - before, flops)
"""


@pytest.mark.slow
def test_a_changed_kernel_misses_the_records_and_compiles_for_real(tmp_path):
    """Programs for compile-only TPUs and GPUs are answered from records
    (`jaxserve.compile_records`) only for the same module: a kernel's source is part of
    the key, so an edited kernel compiles again, for real. Where its code sits (its
    lines, its file's path) is not: test processes lower without source locations
    (tests/conftest.py)."""
    lines = [line.split() for line in _python(KERNEL_CHANGE, tmp_path)]
    for target in ("v5e", "h100"):
        first, again, moved, changed = [line[1:] for line in lines if line[0] == target]
        assert first[:2] == ["False", "1"]  # compiled
        assert again[:2] == ["True", "0"]  # the record: nothing built
        assert again[2:] == first[2:]
        assert moved[:2] == ["True", "0"]  # the same code elsewhere: the record again
        assert changed[:2] == ["False", "1"]  # the edited kernel: compiled again
        if target == "v5e":  # Mosaic's custom call carries the kernel's declared cost
            assert (first[2], changed[2]) == ("1000", "3000")
    assert len(os.listdir(tmp_path / "compile-only")) == 4  # a record per program compiled
