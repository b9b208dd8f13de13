"""jaxserve against Hugging Face transformers `generate`, same weights, same workload, one run.

  python benchmarks/compare_hf.py --model=DIR --num_requests=128 --batch_size=64
  (defaults: prompts of 64-512 tokens, each asking for 16-256 new tokens)

The workload is `jaxserve bench`'s `random` one (seeded): prompt and output
lengths vary as real traffic does. transformers runs static batches of
`batch_size` requests in arrival order, left-padded, each batch generating
until its longest request is done (greedy, EOS ignored); jaxserve takes all
requests at once (continuous batching), timed from the `generate` call as a
user runs it: `LLM(...)` compiled every step program at start-up (excluded, as
every engine's start-up is), and prefix caching is off unless --prefix_caching
(the workload's prompts share nothing, and transformers caches nothing).
Throughput counts only the tokens each request asked for. transformers runs one
small batch untimed first (allocator warm-up). Needs the test extra (torch,
transformers).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.bench.workloads import random_workload


def run_hf(model, reqs, batch_size: int) -> None:
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start : start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding, as generate expects
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new = max(r.max_tokens for r in batch)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )


def run_jaxserve(llm, reqs) -> None:
    llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
        [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs],
        use_tqdm=False,
    )


def timed(fn, warmup) -> float:
    warmup()  # untimed: compilation, allocator warm-up
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--num_requests", type=int, default=128)
    p.add_argument("--input_len", type=int, default=288)
    p.add_argument("--output_len", type=int, default=136)
    p.add_argument("--range_ratio", type=float, default=0.78)
    p.add_argument("--output_range_ratio", type=float, default=0.88)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_num_seqs", type=int, default=64)
    p.add_argument("--max_num_batched_tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--prefix_caching", action="store_true", help="jaxserve's prefix cache on")
    p.add_argument("--output_json", default="compare_hf.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len * 2 + args.output_len * 2,
        enable_prefix_caching=args.prefix_caching,
    )
    reqs = random_workload(
        args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        vocab=llm.config.model.vocab_size,
    )
    useful = sum(r.max_tokens for r in reqs)
    base = llm.engine.stats()
    jax_s = timed(lambda: run_jaxserve(llm, reqs), lambda: None)
    after = llm.engine.stats()
    host = after.host_seconds - base.host_seconds
    device = after.device_seconds - base.device_seconds
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    # transformers compiles nothing: one small batch warms its allocator.
    hf_s = timed(
        lambda: run_hf(hf, reqs, args.batch_size), lambda: run_hf(hf, reqs[:2], args.batch_size)
    )
    result = {
        "model": args.model,
        "requests": len(reqs),
        "useful_output_tokens": useful,
        "prompt_tokens": int(np.sum([len(r.prompt_token_ids) for r in reqs])),
        "jaxserve_s": jax_s,
        "hf_s": hf_s,
        "jaxserve_output_tokens_per_s": useful / jax_s,
        "hf_output_tokens_per_s": useful / hf_s,
        "speedup": hf_s / jax_s,
        "jaxserve_max_num_seqs": args.max_num_seqs,
        "jaxserve_prefix_caching": args.prefix_caching,
        "jaxserve_compilations_during_run": after.num_compiles - base.num_compiles,
        "jaxserve_host_overhead_frac": host / (host + device),
        "jaxserve_kv_waste_at_peak_frac": after.kv_waste_at_peak,
        "jaxserve_peak_kv_pages": after.peak_kv_pages,
        "hf_batch_size": args.batch_size,
        "date": time.strftime("%Y-%m-%d"),
    }
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    print(f"\njaxserve / transformers throughput: {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
