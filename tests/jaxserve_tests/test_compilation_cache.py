"""The persistent compilation cache: a second start loads every step program, and
processes sharing the cache lock it (an unlocked, half-written entry crashed a
reader in another process). It is JAX's, process-wide: the command line sets it and
`LLM(compilation_cache_dir=...)` opts in; constructing an engine never does."""

import os
import subprocess
import sys

import pytest

SNIPPET = """
import sys
from jaxserve import LLM
llm = LLM("demo-model-tiny", max_num_seqs=4, max_num_batched_tokens=64,
          compilation_cache_dir=sys.argv[1])
c = llm.engine.runner.compiles
print("built", c.count, "from_cache", c.cache_hits)
"""


def _start(cache_dir):
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET, str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("built"))
    _, built, _, hits = line.split()
    return int(built), int(hits)


@pytest.mark.slow
def test_a_second_start_loads_every_program_from_the_locked_cache(tmp_path):
    built, hits = _start(tmp_path)
    assert built > 0 and hits == 0
    again, hits = _start(tmp_path)
    assert again == built and hits == built  # every program came from the cache
    assert ".lockfile" in os.listdir(tmp_path)  # JAX locks it once its size is bounded


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
with LLM("demo-model-tiny", **small) as llm:
    config = llm.config
print("LLM()", jax.config.jax_compilation_cache_dir)
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


@pytest.mark.slow
def test_only_the_command_line_and_an_opted_in_llm_set_the_cache(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", WHO_SETS_IT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-4:] == [
        "LLM() None",
        "LLMEngine None",
        "flag default True",
        f"command line {tmp_path}",
    ]
