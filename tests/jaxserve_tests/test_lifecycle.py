"""Lifecycles: `LLM`, `LLMEngine` and every front close, and what they held comes back.

Twenty engines are opened and closed in this one process, each kind in turn: an
`LLM` in a `with` block (with a disk KV tier and its offload thread, and a
structured-output request that starts the grammar compiler's thread), an `LLM`
closed by `close()`, an `AsyncLLMEngine` front, and a `DataParallelEngine` of two
local replicas. Each generates a few tokens first. After each close, no thread of
it runs, no file of it is open, JAX has no monitoring listener of it and no array
of it, and over the twenty the resident memory stays within a bound. Every closed
object is kept referenced, as a caller's `with LLM(...) as llm:` keeps `llm`:
closing must drop the device buffers, not wait for the object to be collected.
"""

import asyncio
import ctypes
import functools
import gc
import os
import threading

import jax
import pytest
from jax._src import monitoring

from jaxserve import LLM, SamplingParams
from jaxserve.async_engine import AsyncLLMEngine
from jaxserve.config import EngineConfig, ModelConfig, engine_config
from jaxserve.distributed.data_parallel import DataParallelEngine, replica_engines, stream_all
from jaxserve.engine import LLMEngine
from jaxserve.front import EngineDeadError
from jaxserve.generate_request import GenerateRequest
from jaxserve.llm import resolve_model_dir
from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer
from pallas_kernels.cpu import cache as kernel_cache

NUM_ENGINES = 20
# The embedded tiny model (~1M float32 parameters: ~4 MiB of weights) with a KV pool of
# 1024 pages of 16 tokens at 1 KiB a token (2 layers x K,V x 2 heads x 32 x 4 bytes):
# 16 MiB. Such an engine (all but the `with` block's, whose pool is small) holds ~20
# MiB of buffers, so one kept after its close grows RSS by that much; compiling as
# shapes occur keeps each engine's start fast (~0.3 s once the first compiled).
SMALL = dict(
    warmup=False,
    max_model_len=128,
    block_size=16,
    num_kv_pages=1024,
    max_num_seqs=4,
    max_num_batched_tokens=64,
)
ENGINE_MIB = 20
# RSS may grow from the 9th engine to the 20th by less than two engines' buffers: the
# first two of each kind fill what a process keeps once (JAX's compiled programs and
# tracing caches), and what the closed objects kept here still hold is host memory of
# about 1 MiB each (the `LLM`'s tokenizer, ~1.2 MiB; the page pool's tables): 16 MiB
# seen over 15 engines. Keeping their buffers grew it by 337 MiB. (From the 5th, after
# other test modules in the process, the second data-parallel engine, the 8th, still
# grew it by 27 MiB, and 54 MiB in all: [1085, 1096, 1102, 1133, 1135, 1136, 1136,
# 1163, 1164, 1165, 1165, 1168, 1170, 1171, 1171, 1174, 1175, 1176, 1176, 1189].)
RSS_GROWTH_MIB = 2 * ENGINE_MIB
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def rss_mib() -> float:
    """Resident memory once garbage is collected and glibc gave back what it keeps
    freed (in the arena of each thread that allocated: engine threads come and go)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def live_buffers() -> tuple[int, int]:
    """(arrays, bytes) of every JAX array alive in the process."""
    arrays = jax.live_arrays()
    return len(arrays), sum(a.nbytes for a in arrays)


def num_listeners() -> int:
    """JAX's process-wide monitoring listeners (each runner registers two)."""
    return len(monitoring.get_event_listeners()) + len(monitoring.get_event_duration_listeners())


def with_block(i: int, tmp_path):
    """An `LLM` closed by its `with` block, with a grammar and a disk KV tier behind a
    pool of 16 pages, which four prompts of 7 pages each overflow: evicted pages go
    to the tier on its offload thread."""
    tier = dict(kv_offload_bytes=1 << 20, kv_offload_dir=str(tmp_path / f"kv{i}"))
    prompts = [{"prompt_token_ids": [5 + j] * 100} for j in range(4)] + ["Is it?"]
    choice = SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    with LLM("demo-model-tiny", **{**SMALL, "num_kv_pages": 16}, **tier) as llm:
        outs = llm.generate(prompts, [GREEDY] * 4 + [choice], use_tqdm=False)
        assert any(t.name.startswith("kv-offload") for t in threading.enumerate())
    assert len(outs[0].outputs[0].token_ids) == 4 and outs[4].outputs[0].text in ("yes", "no")
    assert llm.engine.closed and llm.engine.runner.kv_caches is None
    assert llm.engine.tier.stats.stores > 0 and os.listdir(tier["kv_offload_dir"])
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["Hello"], GREEDY, use_tqdm=False)
    return llm


def closed_by_call(i: int, tmp_path):
    llm = LLM("demo-model-tiny", **SMALL)
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.close()
    llm.close()  # idempotent
    return llm


async def drain(front, request_id: str) -> list[int]:
    request = GenerateRequest(request_id, (5, 6, 7), GREEDY)
    outs = [out async for out in front.generate(request)]
    return outs[-1].outputs[0].token_ids


@functools.cache
def tiny(data_parallel_size: int = 1) -> tuple[EngineConfig, Tokenizer]:
    """The engine config of `LLM("demo-model-tiny", **SMALL)`, and its tokenizer."""
    path = resolve_model_dir("demo-model-tiny")
    config = engine_config(
        path,
        ModelConfig.from_pretrained(path),
        native_kernels_dir=kernel_cache.default_dir(os.environ),  # as LLM's
        data_parallel_size=data_parallel_size,
        **SMALL,
    )
    return config, Tokenizer(path)


def async_front(i: int, tmp_path):
    with AsyncLLMEngine(LLMEngine(*tiny())) as front:
        assert len(asyncio.run(drain(front, "a"))) == 4
    assert not front.healthy and front.engine.closed
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(drain(front, "b"))
    return front


def data_parallel(i: int, tmp_path):
    """Two local replicas on the one CPU device (`replica_engines` slices the given
    devices; `LLM(data_parallel_size=2)` would need two)."""
    config, tokenizer = tiny(data_parallel_size=2)
    device = jax.devices()[0]
    engines = replica_engines(config, tokenizer, devices=[device, device])
    front = DataParallelEngine([AsyncLLMEngine(e) for e in engines], config)
    requests = [GenerateRequest(str(j), (5, 6, 7 + j), GREEDY) for j in range(4)]
    done = []
    stream_all(front, requests, lambda j, out: out.finished and done.append(j))
    assert sorted(done) == [0, 1, 2, 3] and all(r.num_requests == 0 for r in front.replicas)
    front.close()
    front.close()  # idempotent
    assert all(e.closed for e in engines)
    return front


KINDS = [with_block, closed_by_call, async_front, data_parallel]


@pytest.mark.slow
def test_twenty_engines_opened_and_closed_leave_threads_fds_listeners_and_memory(tmp_path):
    gc.collect()
    threads, fds = set(threading.enumerate()), num_fds()
    buffers, listeners = live_buffers(), num_listeners()
    kept, rss = [], []
    for i in range(NUM_ENGINES):
        kind = KINDS[i % len(KINDS)]
        kept.append(kind(i, tmp_path))
        rss.append(rss_mib())  # (collects garbage first)
        what = f"engine {i + 1} ({kind.__name__})"
        # tqdm's monitor is the process's, started by the first progress bar.
        new = [t.name for t in set(threading.enumerate()) - threads if t.name != "tqdm_monitor"]
        assert not new, f"{what}: threads left running"
        assert num_fds() <= fds, f"{what}: file descriptors left open"
        assert num_listeners() == listeners, f"{what}: JAX monitoring listeners left"
        # Its weights and KV caches are gone although the closed object is kept.
        arrays, nbytes = live_buffers()
        assert arrays <= buffers[0] and nbytes <= buffers[1], f"{what}: {nbytes} bytes left"
    settled = 2 * len(KINDS)  # engines: two of each kind
    growth = rss[-1] - rss[settled]
    assert growth < RSS_GROWTH_MIB, (
        f"RSS grew {growth:.0f} MiB from engine {settled + 1} to engine {NUM_ENGINES} "
        f"(bound {RSS_GROWTH_MIB} MiB): {[round(r) for r in rss]}"
    )
    assert len(kept) == NUM_ENGINES  # (every closed object kept referenced until here)
