"""Multi-LoRA serving cost: no LoRA vs adapters, interleaved in one process.

  python benchmarks/lora.py --model=DIR [--rounds=3] [--batch=16] [--num_requests=64]

One engine without LoRA and one with `enable_lora` (`--max_loras` slots of rank
`--rank`) on the same model, both running at most `--batch` requests at once
(max_num_seqs), run the same seeded `--num_requests` requests (greedy, EOS ignored,
all submitted at once: more than the batch, so that the scheduler keeps it full as
a server's queue would), in alternating rounds so that a drifting machine load
affects all alike:

- `no_lora`: the engine without LoRA;
- `lora_base`: the LoRA engine, no request with an adapter (what the wrapped
  projections cost when unused);
- `one_adapter`: every request under one adapter;
- `mixed`: `--num_adapters` adapters (default 8, more than the slots) spread
  over the requests: the requests of adapters without a slot wait until one
  drains, and their adapters are written in (swaps).

Reports output tokens/s per round and their medians, each mode's median over
`no_lora`'s, the slot writes and evictions of a `mixed` round, and the swap cost:
the time of one slot write (an adapter of every projection, host -> device),
median over `--writes` writes. Adapters are random (every projection, rank
`--rank`), written as PEFT saves them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
from startup import _cpu_name

MODES = ("no_lora", "lora_base", "one_adapter", "mixed")


def write_adapter(path: str, modules: dict, rank: int, seed: int) -> None:
    """A random PEFT adapter on every projection in `modules` (name -> (in, out))."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rs = np.random.RandomState(seed)
    tensors = {}
    for name, (d_in, d_out) in modules.items():
        key = f"base_model.model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (rs.randn(rank, d_in) / d_in**0.5).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = (0.01 * rs.randn(d_out, rank)).astype(np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = sorted({n.rsplit(".", 1)[-1] for n in modules})
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=targets)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="demo-model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    p.add_argument("--batch", type=int, default=16, help="max_num_seqs")
    p.add_argument("--num_requests", type=int, default=64)
    p.add_argument("--input_len", type=int, default=128)
    p.add_argument("--output_len", type=int, default=64)
    p.add_argument("--max_loras", type=int, default=4)
    p.add_argument("--num_adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--writes", type=int, default=20, help="timed slot writes")
    p.add_argument("--warmup", type=int, default=1, help="0: compile as shapes occur")
    args = p.parse_args()

    import jax

    from jaxserve import LLM, LoRARequest, SamplingParams

    kw = dict(
        dtype=args.dtype,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(512, args.batch),
        max_model_len=args.input_len * 2 + args.output_len,
        enable_prefix_caching=False,  # every round computes the same work
        compilation_cache_dir=None,
        skip_tokenizer_init=True,
        warmup=bool(args.warmup),
    )
    # Every adapter stays in host memory: the mixed rounds measure slot writes, not reads.
    lora_kw = dict(
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.rank,
        max_cpu_loras=max(args.max_loras, args.num_adapters),
    )
    llms = {"plain": LLM(args.model, **kw), "lora": LLM(args.model, **kw, **lora_kw)}
    root = tempfile.mkdtemp(prefix="lora-bench-")
    modules = llms["lora"].engine.adapters.layout.modules
    adapters = []
    for i in range(args.num_adapters):
        write_adapter(os.path.join(root, f"a{i}"), modules, args.rank, seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, os.path.join(root, f"a{i}")))
    vocab = llms["plain"].engine.config.model.vocab_size
    rs = np.random.RandomState(0)
    prompts = [
        {"prompt_token_ids": rs.randint(16, vocab, size=args.input_len).tolist()}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n = args.num_requests
    per_mode = {
        "no_lora": ("plain", None),
        "lora_base": ("lora", None),
        "one_adapter": ("lora", [adapters[0]] * n),
        "mixed": ("lora", [adapters[i % args.num_adapters] for i in range(n)]),
    }
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    swaps = {}
    order = list(MODES) + list(reversed(MODES))
    for mode in (order * args.rounds)[: len(MODES) * args.rounds]:
        name, loras = per_mode[mode]
        llm = llms[name]
        slots = llm.engine.adapters.slots if llm.engine.adapters else None
        before = (slots.num_loads, slots.num_evictions) if slots else (0, 0)
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        rates[mode].append(n * args.output_len / (time.perf_counter() - t0))
        if mode == "mixed":
            swaps = {
                "slot_writes": slots.num_loads - before[0],
                "evictions": slots.num_evictions - before[1],
            }

    # Swap cost: one slot write, the adapter's matrices from host memory to the device.
    runner = llms["lora"].engine.runner
    adapter = llms["lora"].engine.adapters.cache.adapters()[-1]
    times = []
    for i in range(args.writes):
        t0 = time.perf_counter()
        runner.load_lora(1 + i % args.max_loras, adapter)
        jax.block_until_ready(runner.weights)
        times.append(time.perf_counter() - t0)
    medians = {m: statistics.median(r) for m, r in rates.items()}
    result = {
        "model": args.model,
        "device": jax.devices()[0].device_kind,
        "cpu": _cpu_name(),
        "batch": args.batch,
        "num_requests": n,
        "max_loras": args.max_loras,
        "rank": args.rank,
        "output_tokens_per_s": rates,
        "median_output_tokens_per_s": medians,
        "median_over_no_lora": {m: v / medians["no_lora"] for m, v in medians.items()},
        "mixed_round": swaps,
        "slot_write_ms_median": 1e3 * statistics.median(times),
        "adapter_mib": adapter.nbytes / 2**20,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
