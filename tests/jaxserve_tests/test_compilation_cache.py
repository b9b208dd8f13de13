"""The persistent compilation cache: a second start loads every step program, and
processes sharing the cache lock it (an unlocked, half-written entry crashed a
reader in another process)."""

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
