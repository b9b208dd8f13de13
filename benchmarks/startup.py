"""Start-up to ready, and the first `generate` a user runs, as a user would.

  python benchmarks/startup.py --model=DIR --cache_dir=/tmp/xla-cache [--workload]

Builds `LLM(model, warmup=True)` (every step program compiled before it returns)
and reports the seconds to ready, the programs compiled, and the compile seconds.
Run it twice with the same --cache_dir: the first run is cold, the second reuses
JAX's persistent compilation cache (each run is its own process, as a restart
is). With --workload it then times one `generate` of the start-up workload: 48
requests, prompts of 32-256 random tokens, 16-128 new tokens each, greedy, EOS
ignored (the same seeded workload every run).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def workload(vocab: int, n: int = 48, seed: int = 0):
    rs = np.random.RandomState(seed)
    prompts = [
        {"prompt_token_ids": rs.randint(16, vocab, size=rs.randint(32, 257)).tolist()}
        for _ in range(n)
    ]
    return prompts, [int(x) for x in rs.randint(16, 129, size=n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--cache_dir", default="", help="persistent compilation cache ('' = off)")
    p.add_argument("--max_num_seqs", type=int, default=16)
    p.add_argument("--max_num_batched_tokens", type=int, default=2048)
    p.add_argument("--max_model_len", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workload", action="store_true")
    args = p.parse_args()

    t0 = time.perf_counter()
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        warmup=True,
        compilation_cache_dir=args.cache_dir or None,
    )
    ready = time.perf_counter() - t0
    engine = llm.engine
    result = {
        "model": args.model,
        "cpu": _cpu_name(),
        "ready_s": ready,
        "programs_compiled_at_start": engine.stats().num_compiles,
        "warmup_s": engine.model_info().warmup_seconds,
    }
    if args.workload:
        prompts, lens = workload(llm.config.model.vocab_size)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        before = engine.stats().num_compiles
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(
            generate_s=elapsed,
            output_tokens=tokens,
            output_tokens_per_s=tokens / elapsed,
            programs_compiled_in_generate=engine.stats().num_compiles - before,
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
