"""A hybrid KV cache (sliding-window layers freeing their pages) against one pool for
every layer, at a fixed KV byte budget, for a Gemma-3-shaped model.

  python benchmarks/hybrid_kv.py capacity [--kv_gib=20]
  python benchmarks/hybrid_kv.py throughput [--scale=16] [--kv_mib=24] [--dtype=float32]

`capacity`: Gemma-3-27B's KV shape (62 layers: 52 local of window 1,024 and 10
global, 16 KV heads of 128, bfloat16, pages of 16) in `--kv_gib` per device, at
max_model_len 8k and 32k. For each, the pools `EngineConfig.kv_group_pages` makes
with and without `disable_hybrid_kv_cache_manager`, and how many sequences of
max_model_len they hold: by the split's arithmetic, and by the allocator itself
(`KVGroups` and the scheduler's caching, sequences prefilled chunk by chunk, the
windowed pages given back as they go, until a group has no page left). Also the
static split's other side: sequences shorter than max_model_len (1k to 8k tokens),
which the windowed group bounds.

`throughput`: a small random Gemma-3-shaped model (6 layers, 5 local + 1 global)
served by the engine on this machine's device, the same workload with and without
the hybrid cache in the same KV bytes (`--kv_mib`); contexts and window scaled down
by `--scale` from 8k / 32k and 1,024 (the CPU cannot run 27B at 32k). Each request
is max_model_len long (`--output_len` of it generated, greedy, EOS ignored), so the
KV pages bound how many run at once; a step takes a whole prompt (`--step_tokens`),
so that admission, not a half-prefilled prompt's next chunk, meets the bound.
Reports output tokens/s over the second of two identical rounds (the first
compiles), the most sequences that ran at once, and preemptions. Needs torch and
transformers (the random checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time

GEMMA3_27B = dict(  # Gemma 3 27B's text config, as far as the KV cache sees it
    architectures=["Gemma3ForCausalLM"],
    vocab_size=262208,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=62,
    num_attention_heads=32,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=131072,
    sliding_window=1024,
    sliding_window_pattern=6,
)


def _device_name() -> str:
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        return device.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _config(model, context: int, hybrid: bool, **kw):
    from jaxserve.config import engine_config

    return engine_config(
        "bench",
        model,
        max_model_len=context,
        disable_hybrid_kv_cache_manager=not hybrid,
        **kw,
    )


def allocator_capacity(config, length: int) -> int:
    """Sequences of `length` tokens the pools hold at once, found by allocating: each
    prefilled in chunks of max_num_batched_tokens, cached (windowed groups give back
    their dead pages), until some group cannot give the next chunk its pages."""
    from jaxserve.kv.groups import KVGroups
    from jaxserve.kv.page_pool import PagePool
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.scheduler import Scheduler
    from jaxserve.sequence import SequenceState

    page, chunk = config.cache.page_size, config.scheduler.max_num_batched_tokens
    pools = [PagePool(n, enable_prefix_caching=False) for n in config.kv_group_pages()]
    kv = KVGroups(pools, [g.window for g in config.kv_groups], page)
    sched = Scheduler(config.scheduler, pools[0], page_size=page, kv=kv)
    params = SamplingParams(max_tokens=1)
    held = 0
    while True:
        seq = SequenceState(str(held), 0, [held % 1000 + 1] * length, params, 1, held)
        done = 0
        while done < length:
            n = min(chunk, length - done)
            if not kv.grow(seq, done + n):
                return held
            done += n
            seq.num_computed = done
            sched.cache_pages(seq)
        held += 1


def capacity(args) -> dict:
    from jaxserve.config import ModelConfig
    from jaxserve.config import kv_groups as kvg

    model = ModelConfig.from_hf(GEMMA3_27B)
    kw = dict(
        dtype="bfloat16",
        block_size=16,
        max_num_seqs=1024,
        max_num_batched_tokens=args.chunk,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
    )
    rows = []
    shorter = ((8192, 1024), (8192, 4096), (32768, 1024), (32768, 2048), (32768, 8192))
    for context, length in ((8192, 8192), (32768, 32768), *shorter):
        row = {"max_model_len": context, "sequence_tokens": length}
        for hybrid in (False, True):
            config = _config(model, context, hybrid, **kw)
            pages = config.kv_group_pages()
            sizes = dict(page_size=16, pages_per_seq=config.pages_per_seq, chunk=args.chunk)
            arithmetic = min(
                kvg.sequences_held(g, n, **sizes)
                for g, n in zip(config.kv_groups, pages, strict=True)
            )
            row["hybrid" if hybrid else "one_group"] = {
                "groups": [
                    {"window": g.window, "layers": len(g.layers), "pages": n}
                    for g, n in zip(config.kv_groups, pages, strict=True)
                ],
                "max_concurrency_arithmetic": round(arithmetic, 2),
                "max_concurrency_allocator": allocator_capacity(config, length),
            }
        row["ratio"] = round(
            row["hybrid"]["max_concurrency_allocator"]
            / max(1, row["one_group"]["max_concurrency_allocator"]),
            2,
        )
        rows.append(row)
        print(json.dumps(row))
    return {"model": "gemma-3-27b KV shape", "kv_gib_per_device": args.kv_gib, "rows": rows}


def _small_gemma3(path: str, context: int, window: int) -> None:
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=context,
        sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)


def _serve(path: str, context: int, hybrid: bool, args, prompts, max_tokens: int) -> dict:
    from jaxserve.config import ModelConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.generate_request import GenerateRequest
    from jaxserve.sampling_params import SamplingParams

    config = _config(
        ModelConfig.from_pretrained(path),
        context,
        hybrid,
        dtype=args.dtype,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.step_tokens or context,
        kv_cache_memory_bytes=int(args.kv_mib * 2**20),
        warmup=False,
    )
    config = dataclasses.replace(config, model_dir=path)
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    most, done = 0, {}

    def submit(tag: str) -> None:
        for i, p in enumerate(prompts):
            engine.add_request(GenerateRequest(f"{tag}{i}", p, params))

    submit("warm")  # compiles the shapes the workload meets
    while engine.has_unfinished():
        engine.step()
    submit("")
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
    seconds = time.perf_counter() - t0
    tokens = sum(len(t) for t in done.values())
    return {
        "groups": [
            {"window": g.window, "layers": len(g.layers), "pages": n}
            for g, n in zip(engine.runner.kv_groups, engine.runner.group_pages, strict=True)
        ],
        "max_concurrency_logged": round(engine.runner.max_concurrency, 2),
        "most_running": most,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "preemptions": engine.scheduler.num_preemptions,
        "outputs": [done[str(i)] for i in range(len(prompts))],
    }


def throughput(args) -> dict:
    import numpy as np

    window = 1024 // args.scale
    rows = []
    for full_context in (8192, 32768):
        context = full_context // args.scale
        with tempfile.TemporaryDirectory() as path:
            _small_gemma3(path, context, window)
            rs = np.random.RandomState(0)
            max_tokens = args.output_len
            prompts = [
                rs.randint(3, 1024, size=context - max_tokens).tolist()
                for _ in range(args.num_requests)
            ]
            row = {"max_model_len": context, "stands_for": full_context, "window": window}
            for hybrid in (False, True):
                result = _serve(path, context, hybrid, args, prompts, max_tokens)
                row["hybrid" if hybrid else "one_group"] = result
            same = sum(
                a == b
                for a, b in zip(
                    row["one_group"].pop("outputs"), row["hybrid"].pop("outputs"), strict=True
                )
            )
            row["identical_outputs"] = f"{same}/{len(prompts)}"
            row["speedup"] = round(
                row["hybrid"]["output_tokens_per_s"] / row["one_group"]["output_tokens_per_s"], 2
            )
            print(json.dumps(row))
            rows.append(row)
    return {
        "model": "random Gemma-3-shaped, 6 layers (5 local, 1 global), hidden 256, 1 KV head of 64",
        "device": _device_name(),
        "dtype": args.dtype,
        "scale": args.scale,
        "kv_mib": args.kv_mib,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=["capacity", "throughput"])
    p.add_argument("--kv_gib", type=float, default=20.0, help="capacity: KV GiB per device")
    p.add_argument("--chunk", type=int, default=2048, help="capacity: max_num_batched_tokens")
    p.add_argument(
        "--step_tokens", type=int, default=0, help="throughput: the same (0: max_model_len)"
    )
    p.add_argument("--scale", type=int, default=16, help="throughput: contexts divided by it")
    p.add_argument("--kv_mib", type=float, default=24.0, help="throughput: KV MiB")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num_requests", type=int, default=32)
    p.add_argument("--output_len", type=int, default=256)
    p.add_argument("--max_num_seqs", type=int, default=32)
    p.add_argument("--out", default="", help="write the JSON result here")
    args = p.parse_args()
    result = capacity(args) if args.mode == "capacity" else throughput(args)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
