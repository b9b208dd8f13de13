"""Compares the grammar engines for structured output: llguidance and xgrammar.

  python benchmarks/grammar_engines.py --tokenizer=DIR [--vocab_size=N] [--xgrammar_path=P]

For one tokenizer directory (tokenizer.json), measures per engine: building its
tokenizer info (once per engine), compiling each spec below (once per distinct
spec), and the per-step host work for one row: filling the row's bitmask of the
whole vocabulary and advancing the matcher by one token, stepped along a valid
output of the spec (its tokens from the tokenizer). `--vocab_size` is the
model's vocabulary (>= the tokenizer's; the padding ids must be blocked).

xgrammar needs torch and transformers at run time (its bitmask is a torch
tensor); point `--xgrammar_path` at a directory it was installed into with
`pip install --no-deps --target P xgrammar apache-tvm-ffi` to include it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "role"],
}
INSTANCE = (
    '{"name": "Alice", "age": 42, "email": "alice@example.com", "tags": ["a", "bb", "ccc"], '
    '"address": {"city": "Paris", "zip": "75001"}, "role": "admin", "score": 3.25}'
)
REGEX = r"(\d{3})-(\d{3})-(\d{4}) [a-z]+@[a-z]+\.(com|org)"
REGEX_TEXT = "555-123-4567 bob@example.org"


def _median_ms(xs):
    return 1e3 * statistics.median(xs)


def bench_llguidance(tok_json: str, vocab: int, eos: int, ids: dict) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, n_vocab=vocab, eos_token=eos)
    out = {"tokenizer_s": time.perf_counter() - t}
    grammars = {
        "json_schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
        "regex": llguidance.LLMatcher.grammar_from_regex(REGEX),
    }
    mask = lnp.allocate_token_bitmask(1, vocab)
    for name, grammar in grammars.items():
        t = time.perf_counter()
        err = llguidance.LLMatcher.validate_grammar(grammar, None)
        validate_s = time.perf_counter() - t
        assert not err, err
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_s = time.perf_counter() - t
        assert not m.is_error(), m.get_error()
        t = time.perf_counter()
        copies = [m.deep_copy() for _ in range(16)]
        copy_s = (time.perf_counter() - t) / 16
        fills, consumes = [], []
        for tok in ids[name]:
            t = time.perf_counter()
            lnp.fill_next_token_bitmask(copies[0], mask, 0)
            fills.append(time.perf_counter() - t)
            assert (mask[0, tok // 32] >> (tok % 32)) & 1, f"token {tok} masked out"
            t = time.perf_counter()
            assert copies[0].consume_token(tok), copies[0].get_error()
            consumes.append(time.perf_counter() - t)
        out[name] = {
            "validate_ms": 1e3 * validate_s,
            "compile_ms": 1e3 * compile_s,
            "copy_ms": 1e3 * copy_s,
            "fill_ms_median": _median_ms(fills),
            "fill_ms_max": 1e3 * max(fills),
            "consume_ms_median": _median_ms(consumes),
            "steps": len(fills),
        }
    return out


def bench_xgrammar(tok_dir: str, vocab: int, ids: dict) -> dict:
    t = time.perf_counter()
    import transformers
    import xgrammar as xgr

    out = {"import_s": time.perf_counter() - t}
    path = os.path.join(tok_dir, "tokenizer.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    out["tokenizer_s"] = time.perf_counter() - t
    specs = {
        "json_schema": lambda: compiler.compile_json_schema(json.dumps(SCHEMA)),
        "regex": lambda: compiler.compile_regex(REGEX),
    }
    mask = xgr.allocate_token_bitmask(1, vocab)
    for name, compile_fn in specs.items():
        t = time.perf_counter()
        compiled = compile_fn()
        compile_s = time.perf_counter() - t
        m = xgr.GrammarMatcher(compiled)
        fills, consumes = [], []
        for tok in ids[name]:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            fills.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert m.accept_token(tok)
            consumes.append(time.perf_counter() - t)
        out[name] = {
            "compile_ms": 1e3 * compile_s,
            "fill_ms_median": _median_ms(fills),
            "fill_ms_max": 1e3 * max(fills),
            "consume_ms_median": _median_ms(consumes),
            "steps": len(fills),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    p.add_argument("--vocab_size", type=int, default=None, help="model vocabulary (padded)")
    p.add_argument("--xgrammar_path", default=None)
    args = p.parse_args()
    import tokenizers

    path = os.path.join(args.tokenizer, "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(path)
    vocab = args.vocab_size or tok.get_vocab_size(with_added_tokens=True)
    eos = 0
    ids = {
        "json_schema": tok.encode(INSTANCE, add_special_tokens=False).ids,
        "regex": tok.encode(REGEX_TEXT, add_special_tokens=False).ids,
    }
    results = {
        "tokenizer_vocab": tok.get_vocab_size(with_added_tokens=True),
        "model_vocab": vocab,
        "llguidance": bench_llguidance(tok.to_str(), vocab, eos, ids),
    }
    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
        try:
            results["xgrammar"] = bench_xgrammar(args.tokenizer, vocab, ids)
        except Exception as e:  # reported beside the other engine's numbers
            results["xgrammar"] = {"error": repr(e)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
