"""Beam search in the continuous batch against the same beams run as independent requests.

  python benchmarks/beam_search.py [--model=demo-model] [--prompts=8] [--prompt_len=128]
      [--beam_width=4] [--max_tokens=32] [--repeats=3] [--output=FILE]

On one `LLM` (warm-up on, prefix caching on), the same search three ways:
  - engine: `LLM.beam_search`: the beams are sequences of the continuous batch, forked
    copy-on-write, every prompt's search in the same steps;
  - one-token requests: the same beam search (`jaxserve.beam_search.BeamGroup`) driven
    from outside, each step one `generate` of a one-token request per beam
    (logprobs 2k; vLLM's `LLM.beam_search` loop), the prefix cache finding each beam's
    history;
  - independent samples: as many plain requests as beams (k per prompt, max_tokens
    each, EOS ignored): what decoding the same number of sequences costs unsearched.
Both searches run with ignore_eos, so every beam lives max_tokens steps, and must
return the same sequences. Each figure is the median of --repeats runs, with beam
tokens/s (prompts x beam_width x max_tokens over the wall time), the KV pages held
at the peak of the run, engine steps, and the copy-on-write page copies made; and
the page-copy program's time per call for each pair count (what a step that forks
adds; copies folded into the step as a fixed-shape input would cost the largest
count's on every step).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
        return names[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return platform.processor() or platform.machine()


def _peak_pages(llm):
    """Wraps the engine's step to record the most KV pages in use; returns a getter."""
    engine, peak = llm.engine, [0]
    step = engine.step

    def recording():
        out = step()
        peak[0] = max(peak[0], engine.pool.capacity - engine.pool.num_free)
        return out

    engine.step = recording
    return peak


def _counting(llm):
    """Counts the engine's steps and its copy-on-write page copies; returns the counts."""
    engine, runner, counts = llm.engine, llm.engine.runner, {"steps": 0, "copies": 0}
    step, copy = engine.step, runner.copy_program

    def stepping():
        counts["steps"] += 1
        return step()

    def copying(kv_caches, pairs):
        counts["copies"] += int((pairs[:, 1] != 0).sum())
        return copy(kv_caches, pairs)

    engine.step, runner.copy_program = stepping, copying
    return counts


def _copy_program_ms(llm, repeats: int = 50) -> dict[int, float]:
    """The copy program's time per call (ms, median), for each compiled pair count: what
    a step with forks adds. Copies folded into every step would cost the largest
    count's on every step (a fixed-shape input of S pairs), forks or not."""
    import jax
    import numpy as np

    runner, out = llm.engine.runner, {}
    for n in runner.copy_buckets:
        pairs = np.zeros((n, 2), np.int32)
        pairs[:, 0] = np.arange(1, n + 1)
        pairs[:, 1] = np.arange(n + 1, 2 * n + 1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.kv_caches = runner.copy_program(runner.kv_caches, pairs)
            jax.block_until_ready(runner.kv_caches)
            times.append(time.perf_counter() - t0)
        out[n] = round(statistics.median(times) * 1e3, 3)
    return out


def _one_token_requests(llm, prompts, params):
    """The beam search as a loop of one-token requests (vLLM's way): each step, every
    running beam of every prompt is a request for one token with 2k logprobs."""
    from jaxserve.beam_search import BeamGroup
    from jaxserve.sampling_params import SamplingParams

    k = params.beam_width
    groups = [BeamGroup(params, (), root=(i, ())) for i in range(len(prompts))]
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * k, ignore_eos=True)
    while not all(g.done for g in groups):
        beams = [(g, b) for g in groups if not g.done for b in g.running]
        outs = llm.generate(
            [{"prompt_token_ids": prompts[b.handle[0]] + b.token_ids} for _, b in beams],
            step_params,
            use_tqdm=False,
        )
        for (g, b), out in zip(beams, outs, strict=True):
            entry = out.outputs[0].logprobs[0]
            best = sorted(entry.items(), key=lambda kv: -kv[1])[: 2 * k]
            g.offer(b.handle, [t for t, _ in best], [lp for _, lp in best])
        for g in groups:
            if not g.done and g.candidates:
                for beam in g.step():
                    beam.handle = (beam.handle[0], tuple(beam.token_ids))
    return [[h.token_ids for h in g.finished] for g in groups]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo-model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--beam_width", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import BeamSearchParams

    k, m = args.beam_width, args.max_tokens
    llm = LLM(
        args.model,
        max_model_len=args.prompt_len + m + 8,
        max_num_seqs=max(16, args.prompts * k),
        max_num_batched_tokens=512,
        num_kv_pages=2048,
        block_size=16,
    )
    vocab = llm.config.model.vocab_size
    rs = np.random.RandomState(0)
    prompts = [rs.randint(1, vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    params = BeamSearchParams(beam_width=k, max_tokens=m, ignore_eos=True)
    beam_tokens = args.prompts * k * m
    peak = _peak_pages(llm)
    copy_ms = _copy_program_ms(llm)  # (before any request: the pages copied hold nothing)
    counts = _counting(llm)
    results, outputs = {}, {}

    def engine_search():
        res = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        pairs = zip(prompts, res, strict=True)
        return [[s.tokens[len(p) :] for s in r.sequences] for p, r in pairs]

    def samples():
        sp = SamplingParams(n=k, max_tokens=m, temperature=1.0, seed=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    runs = {
        "engine beam search": engine_search,
        "one-token requests": lambda: _one_token_requests(llm, prompts, params),
        "independent samples": samples,
    }
    compiled = llm.engine.runner.compiles.count
    for name, fn in runs.items():
        times, peaks = [], []
        counts.update(steps=0, copies=0)
        before = llm.engine.stats()
        for _ in range(args.repeats):
            llm.reset_prefix_cache()  # every run starts cold
            peak[0] = 0
            t0 = time.perf_counter()
            outputs[name] = fn()
            times.append(time.perf_counter() - t0)
            peaks.append(peak[0])
        seconds = statistics.median(times)
        after, steps = llm.engine.stats(), max(1, counts["steps"])
        results[name] = {
            # The engine's own split of a step: host work (scheduling, inputs, outputs)
            # and waiting for the device.
            "host_ms_per_step": round((after.host_seconds - before.host_seconds) / steps * 1e3, 2),
            "device_ms_per_step": round(
                (after.device_seconds - before.device_seconds) / steps * 1e3, 2
            ),
            "seconds": round(seconds, 3),
            "beam_tokens_per_s": round(beam_tokens / seconds, 1),
            "peak_kv_pages": max(peaks),
            "steps": counts["steps"] // args.repeats,
            "ms_per_step": round(sum(times) / max(1, counts["steps"]) * 1e3, 2),
            "page_copies": counts["copies"] // args.repeats,
        }
        print(f"{name:>22}: {seconds:7.3f} s  {beam_tokens / seconds:8.1f} tok/s  "
              f"peak {max(peaks)} KV pages")  # fmt: skip
    same = outputs["engine beam search"] == outputs["one-token requests"]
    report = {
        "cpu": _cpu_name(),
        "model": args.model,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "beam_width": k,
        "max_tokens": m,
        "repeats": args.repeats,
        "same_sequences": same,
        "compiled_after_warm_up": llm.engine.runner.compiles.count - compiled,
        "copy_program_ms_by_pairs": copy_ms,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    llm.close()


if __name__ == "__main__":
    main()
