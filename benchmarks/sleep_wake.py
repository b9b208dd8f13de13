"""Sleep and wake-up on a device, measured: the memory JAX reports and the memory the
GPU driver reports (what another process, a trainer, can have), before, asleep and
awake, the seconds each takes, and that the engine gives the same greedy tokens and
compiles nothing again (`LLMEngine.sleep`, `jaxserve.engine.lifecycle`).

  python benchmarks/sleep_wake.py --model=DIR [--num_kv_pages=N] [--out=result.json]

Whether freed memory goes back to the driver is the XLA client's allocator's choice,
set by the environment before JAX starts: by default it reserves 75% of the GPU at
start-up (XLA_PYTHON_CLIENT_PREALLOCATE) and keeps what it frees for this process;
XLA_PYTHON_CLIENT_ALLOCATOR=platform allocates and frees each buffer with the driver.
Run it under each to see both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time


def driver_used_mib() -> int | None:
    """The GPU memory in use as the driver reports it (every process's), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--kv_fraction", type=float, default=0.5)
    parser.add_argument("--num_kv_pages", type=int, default=None, help="(default: the fraction)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention_backend", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import jax
    import numpy as np

    from jaxserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        kv_cache_memory_fraction=args.kv_fraction,
        num_kv_pages=args.num_kv_pages,
        warmup=False,
    )
    engine = llm.engine
    rng = np.random.default_rng(0)
    vocab = engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(1, vocab, 64).tolist()} for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = tokens()
    compiles = engine.runner.compiles.count
    rows = []

    def record(what: str, seconds: float | None = None) -> None:
        jax.effects_barrier()
        report = engine.device_memory()
        report["live_arrays_bytes"] = sum(x.nbytes for x in jax.live_arrays())
        report["driver_used_mib"] = driver_used_mib()
        rows.append({"state": what, "seconds": seconds, **report})
        print(json.dumps(rows[-1]), flush=True)

    record("awake")
    for level in (1, 2):
        t0 = time.perf_counter()
        llm.sleep(level)
        record(f"asleep (level {level})", time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.wake_up()
        record(f"awake again (from level {level})", time.perf_counter() - t0)
        same = tokens() == want
        print(f"level {level}: same greedy tokens after wake-up: {same}", flush=True)
        assert same
    assert engine.runner.compiles.count == compiles, (engine.runner.compiles.count, compiles)
    result = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "allocator": {
            k: os.environ.get(k)
            for k in ("XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_PREALLOCATE")
        },
        "kv_cache_bytes_per_device": engine.runner.kv_bytes_per_device,
        "compiles_across_sleep_and_wake": engine.runner.compiles.count - compiles,
        "rows": rows,
    }
    print("zero compilations across sleep and wake-up; result:", json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    llm.close()


if __name__ == "__main__":
    main()
