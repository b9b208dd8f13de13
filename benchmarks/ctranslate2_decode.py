"""Batch-1 decode speed of CTranslate2 (int8) on an HF model directory, for the
side-by-side with `jaxserve bench --roofline` (issue 14).

    pip install ctranslate2
    ct2-transformers-converter --model DIR --output_dir CT2_DIR --quantization int8
    python benchmarks/ctranslate2_decode.py --model=CT2_DIR [--threads=2]

A random 128-token prompt, 128 generated tokens (greedy, no end token), timed
`--repeats` times; decode tokens/s = 127 / (time for 128 tokens - time for 1),
so the prompt's prefill is not counted.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    import ctranslate2

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a ct2-transformers-converter output dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gen = ctranslate2.Generator(args.model, device="cpu", intra_threads=args.threads)
    with open(f"{args.model}/vocabulary.json") as f:
        vocab = json.load(f)
    rs = np.random.RandomState(0)
    prompt = [vocab[t] for t in rs.randint(3, min(len(vocab), 4000), args.input_len)]

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        out = gen.generate_batch(
            [prompt],
            max_length=n,
            min_length=n,
            include_prompt_in_result=False,
            end_token=[],
            sampling_topk=1,
        )
        assert len(out[0].sequences_ids[0]) == n, len(out[0].sequences_ids[0])
        return time.perf_counter() - t0

    full = [timed(args.output_len) for _ in range(args.repeats)]
    first = [timed(1) for _ in range(args.repeats)]
    decode = (np.median(full) - np.median(first)) / (args.output_len - 1)
    print(
        json.dumps(
            {
                "ctranslate2": ctranslate2.__version__,
                "threads": args.threads,
                "prefill_plus_first_token_s": float(np.median(first)),
                "total_s": float(np.median(full)),
                "decode_step_ms": decode * 1e3,
                "decode_tokens_per_s": 1.0 / decode,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
