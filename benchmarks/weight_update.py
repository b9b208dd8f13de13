"""New weights for a serving engine: an in-process update against building a new LLM.

  python benchmarks/weight_update.py [--model=demo-model] [--repeats=5] [--output=FILE]

On one `LLM` (float32, the small test settings), times `update_weights` with
  - params: the model's nnx.State placed as the engine's weights are (adopted, no copy);
  - numpy: the same arrays on the host (each copied onto the device);
  - orbax: `path=` an orbax model directory (`jaxserve convert`), read onto the device;
  - hf: `path=` the Hugging Face safetensors directory;
each the median of --repeats updates, then the first `generate` after an update (its
prompts recomputed with the new weights) beside the same `generate` before it. For
comparison: building a new `LLM` of the same model, with warm-up (every step program
compiled: a fresh process's cost, unless the compilation cache is warm) and without
(this process already holds the compiled programs, so it compiles nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import jax
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.checkpoint import convert
    from jaxserve.llm import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    kw = dict(
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_kv_pages=256,
        block_size=16,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5 + i, 133 + i))} for i in range(8)]

    t0 = time.perf_counter()
    llm = LLM(model_dir, warmup=True, **kw)
    new_llm_warmup = time.perf_counter() - t0
    runner = llm.engine.runner
    state = runner.model_def.state(runner.weights)
    host = jax.tree.map(np.asarray, state)
    llm.generate(prompts, greedy, use_tqdm=False)
    llm.reset_prefix_cache()
    generate_cold_cache = _median_seconds(
        lambda: (llm.reset_prefix_cache(), llm.generate(prompts, greedy, use_tqdm=False)),
        args.repeats,
    )
    compiles = runner.compiles.count
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        orbax_dir = convert(model_dir, os.path.join(tmp, "orbax"))
        llm.update_weights(path=orbax_dir)  # (the first read of a directory: imports orbax)
        sources = {
            "params": lambda: llm.update_weights(state),
            "numpy": lambda: llm.update_weights(host),
            "orbax": lambda: llm.update_weights(path=orbax_dir),
            "hf": lambda: llm.update_weights(path=model_dir),
        }
        for name, update in sources.items():
            results[f"update_{name}_s"] = _median_seconds(update, args.repeats)
    results["generate_after_update_s"] = (
        _median_seconds(
            lambda: (llm.update_weights(state), llm.generate(prompts, greedy, use_tqdm=False)),
            args.repeats,
        )
        - results["update_params_s"]
    )
    results["compiles_during_updates"] = runner.compiles.count - compiles
    weight_bytes = runner.weight_bytes
    llm.close()
    t0 = time.perf_counter()
    again = LLM(model_dir, warmup=False, **kw)
    new_llm_no_warmup = time.perf_counter() - t0
    again.close()
    out = dict(
        model=args.model,
        weight_mib=round(weight_bytes / 2**20, 1),
        cpu=_cpu_name(),
        jax=jax.__version__,
        repeats=args.repeats,
        new_llm_warmup_s=new_llm_warmup,
        new_llm_no_warmup_s=new_llm_no_warmup,
        generate_cold_cache_s=generate_cold_cache,
        **results,
    )
    print(json.dumps(out, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
