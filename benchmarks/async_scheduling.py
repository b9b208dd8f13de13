"""Synchronous vs asynchronous scheduling, interleaved in one process.

  python benchmarks/async_scheduling.py --model=DIR [--rounds=6] [--num_requests=32]

Two engines on one model runner (the same weights, KV arrays and compiled
programs), one with `async_scheduling=True`, run the same seeded workload (greedy, EOS ignored)
in alternating rounds (sync, async, async, sync, ...), so that a machine whose
load drifts (shared cores) affects both alike. Reports each round's output
tokens/s, the median ratio async / sync, and the engines' host share of the step:
the seconds the host spends outside waiting for the device over all step seconds
(synchronous: the share of the step the device idles while the host works).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from startup import _cpu_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="demo-model")
    p.add_argument("--rounds", type=int, default=6, help="rounds of each mode")
    p.add_argument("--num_requests", type=int, default=32)
    p.add_argument("--input_len", type=int, default=128)
    p.add_argument("--output_len", type=int, default=64)
    p.add_argument("--max_num_seqs", type=int, default=16)
    p.add_argument("--max_num_batched_tokens", type=int, default=512)
    p.add_argument("--max_model_len", type=int, default=512)
    p.add_argument("--cache_dir", default="", help="persistent compilation cache ('' = off)")
    args = p.parse_args()

    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import LLMEngine
    from jaxserve.generate_request import GenerateRequest

    kw = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,  # every round computes the same work
        compilation_cache_dir=args.cache_dir or None,
    )
    llm = LLM(args.model, **kw)
    # The async engine drives the same runner (weights, KV arrays, programs): one copy
    # of the model in memory, and the engines never run at the same time.
    config = llm.engine.config
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, async_scheduling=True)
    )
    engines = {"sync": llm.engine, "async": LLMEngine(config, runner=llm.engine.runner)}
    vocab = config.model.vocab_size
    rs = np.random.RandomState(0)
    lo, hi = args.input_len // 2, args.input_len * 3 // 2
    prompts = [
        {"prompt_token_ids": rs.randint(16, vocab, size=rs.randint(lo, hi + 1)).tolist()}
        for _ in range(args.num_requests)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
        for n in rs.randint(args.output_len // 2, args.output_len * 3 // 2 + 1, args.num_requests)
    ]
    tokens = sum(sp.max_tokens for sp in params)
    rates = {"sync": [], "async": []}
    outputs = {}
    order = ["sync", "async", "async", "sync"] * ((args.rounds + 1) // 2)
    for mode in order[: 2 * args.rounds]:
        engine, done = engines[mode], {}
        t0 = time.perf_counter()
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(GenerateRequest(str(i), prompt["prompt_token_ids"], sp))
        engine.run(lambda out, done=done: done.__setitem__(out.request_id, out))
        rates[mode].append(tokens / (time.perf_counter() - t0))
        outputs[mode] = [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    assert outputs["sync"] == outputs["async"], "async scheduling changed the outputs"
    host = {}
    for mode, engine in engines.items():
        s = engine.stats()
        host[mode] = s.host_seconds / (s.host_seconds + s.device_seconds)
    ratios = [a / s for s, a in zip(rates["sync"], rates["async"], strict=True)]
    result = {
        "model": args.model,
        "cpu": _cpu_name(),
        "output_tokens_per_s": rates,
        "median_sync": statistics.median(rates["sync"]),
        "median_async": statistics.median(rates["async"]),
        "ratio_async_over_sync_per_round_pair": ratios,
        "median_ratio_async_over_sync": statistics.median(ratios),
        "host_share_of_step": host,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
