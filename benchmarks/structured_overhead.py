"""Per-step host overhead of structured output: 16 constrained rows vs none.

  python benchmarks/structured_overhead.py                     # the demo model (vocab 4,096)
  python benchmarks/structured_overhead.py --big_vocab=/tmp/bigvocab

Runs the same 16 decoding requests (64 output tokens each, prompts of 16
tokens) twice on a warmed-up engine: unconstrained, then each under a JSON
schema whose output is longer than 64 tokens (so every row decodes all 64
steps, finishing on "length", in both runs). Reports the engine's host time per
step (scheduling, packing inputs, filling the grammar bitmasks, output
processing with the matchers' advance; the bitmasks are filled after the forward
pass is dispatched, so that part overlaps the device), device time (waiting for
the step's result) and wall time per step, medians over the decode steps, and
the time `build_sampling` alone takes for the 16 rows at the grammar's start.

`--big_vocab=DIR` makes (once) a model with Qwen2.5's vocabulary of 151,936 ids
and tiny layers (so the step is mostly host work and the [16, 151,936] sampler)
with a byte-level BPE tokenizer of 151,643 tokens trained on the Python
standard library's sources (no real tokenizer can be downloaded here). Needs the
test extra (torch, transformers) to make it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["file", "dir", "link"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "kind", "ok"],
        "additionalProperties": False,
    },
}


def make_big_vocab_model(out: str) -> None:
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    os.makedirs(out, exist_ok=True)
    files = sorted(
        glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True)
    )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=151643,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    yield f.read()
            except (UnicodeDecodeError, OSError):
                continue

    tok.train_from_iterator(texts(), trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "add_bos_token": False}, f)
    cfg = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    print(f"wrote {out}: tokenizer of {tok.get_vocab_size()} tokens", file=sys.stderr)


def run(llm, prompts, params) -> tuple[list[float], list[float], list[float]]:
    """Host, device and wall seconds of each step of generating `prompts`."""
    engine = llm.engine
    host, device, wall = [], [], []
    step = engine.step

    def timed():
        s0, t0 = engine.stats(), time.perf_counter()
        out = step()
        s1, t1 = engine.stats(), time.perf_counter()
        host.append(s1.host_seconds - s0.host_seconds)
        device.append(s1.device_seconds - s0.device_seconds)
        wall.append(t1 - t0)
        return out

    engine.step = timed
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step = step
    assert all(len(c.token_ids) == params.max_tokens for o in outs for c in o.outputs)
    return host, device, wall


def build_sampling_ms(llm, params, rows: int = 16, reps: int = 50) -> float:
    """build_sampling for `rows` rows (each with a fresh grammar matcher, if any)."""
    from jaxserve.runner.input_batch import SampleRow

    engine = llm.engine
    grammar = None
    if params.structured_outputs is not None:
        compiler = engine.grammars.compiler()
        template = compiler.compile(params.structured_outputs).result()
        grammar = [compiler.matcher(template) for _ in range(rows)]
    sample_rows = [
        SampleRow(params, list(range(1, 17)), 16, i, (), grammar[i] if grammar else None)
        for i in range(rows)
    ]
    runner = engine.runner
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        runner.build_sampling(sample_rows, runner.seq_bucket(rows))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--big_vocab", default=None, help="model dir with a 151,936 vocabulary")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=64)
    args = p.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import StructuredOutputsParams

    model = None
    if args.big_vocab:
        if not os.path.exists(os.path.join(args.big_vocab, "config.json")):
            make_big_vocab_model(args.big_vocab)
        model = args.big_vocab
    llm = LLM(
        model,
        max_model_len=256,
        max_num_seqs=args.rows,
        max_num_batched_tokens=512,
        block_size=16,
        num_kv_pages=4 * args.rows * 16,
        compilation_cache_dir=None,
    )
    prompts = [{"prompt_token_ids": list(range(100 + i, 116 + i))} for i in range(args.rows)]
    base = dict(temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = SamplingParams(**base)
    constrained = SamplingParams(**base, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    run(llm, prompts[:1], constrained)  # compile the schema (cached from then on)
    result = {"vocab_size": llm.config.model.vocab_size, "rows": args.rows}
    for name, params in (("none", plain), ("constrained", constrained), ("none_again", plain)):
        host, device, wall = run(llm, prompts, params)
        decode = slice(2, None)  # past the prefill steps
        result[name] = {
            "steps": len(host),
            "host_ms_per_decode_step": 1e3 * statistics.median(host[decode]),
            "device_ms_per_decode_step": 1e3 * statistics.median(device[decode]),
            "wall_ms_per_decode_step": 1e3 * statistics.median(wall[decode]),
            "build_sampling_ms": build_sampling_ms(llm, params, args.rows),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
