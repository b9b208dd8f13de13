"""`jaxserve generate`: offline generation for one prompt or a JSONL file of prompts.

  jaxserve generate --prompt="Return the number of" --max_tokens=32   (embedded demo model)
  jaxserve generate --model=DIR --prompt="Once upon a time" --max_tokens=32
  jaxserve generate --model=DIR --input=prompts.jsonl --output=results.jsonl

Each input line is {"prompt": "..."}, {"prompt_token_ids": [...]} or
{"messages": [...]} (rendered with the model's chat template).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import tomllib

from absl import flags

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "model",
    None,
    "Local Hugging Face model directory, or an embedded model's name "
    "(default: the embedded demo-model).",
)
flags.DEFINE_string("prompt", None, "One prompt to complete (or use --input).")
flags.DEFINE_string("input", None, "JSONL file of prompts.")
flags.DEFINE_string("output", None, "JSONL file for the results (default: stdout).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype.")
flags.DEFINE_integer("max_tokens", 64, "Tokens to generate per prompt.")
flags.DEFINE_integer("min_tokens", 0, "Tokens to generate before EOS may stop.")
flags.DEFINE_bool("ignore_eos", False, "Keep generating past EOS.")
flags.DEFINE_integer("max_model_len", None, "Longest prompt + output (default: the model's).")
flags.DEFINE_integer("max_num_seqs", 64, "Sequences per step.")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens per step.")
flags.DEFINE_integer("block_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("num_kv_pages", None, "KV pool size in pages (default: from the budget).")
flags.DEFINE_integer("kv_cache_memory_bytes", 1 << 30, "KV cache budget in bytes.")
flags.DEFINE_string("attention_backend", "reference", "Attention implementation.")
flags.DEFINE_string("config", None, "TOML engine preset (configs/*.toml); flags given override it.")

# Flags that configure the engine, and so may come from a --config preset.
ENGINE_FLAGS = (
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_pages",
    "kv_cache_memory_bytes",
    "attention_backend",
)


def engine_kwargs() -> dict:
    """Engine options: flags given on the command line, else the preset, else flag defaults."""
    preset = {}
    if FLAGS.config:
        with open(FLAGS.config, "rb") as f:
            preset = tomllib.load(f)
        unknown = sorted(set(preset) - set(ENGINE_FLAGS))
        if unknown:
            raise SystemExit(f"{FLAGS.config}: unknown keys {unknown}; known: {ENGINE_FLAGS}")
    return {
        name: FLAGS[name].value if FLAGS[name].present or name not in preset else preset[name]
        for name in ENGINE_FLAGS
    }


def _read_prompts() -> list:
    if (FLAGS.prompt is None) == (FLAGS.input is None):
        raise SystemExit("give exactly one of --prompt and --input")
    if FLAGS.prompt is not None:
        return [FLAGS.prompt]
    prompts = []
    with open(FLAGS.input) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    prompts.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"{FLAGS.input}:{n}: not JSON: {e}") from None
    return prompts


def main(argv) -> None:
    del argv
    try:
        _generate()
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"jaxserve generate: {e}") from None


def _generate() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    prompts = _read_prompts()
    llm = LLM(FLAGS.model, **engine_kwargs())
    engine_prompts = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict) and "messages" in p:
            p = {
                "prompt_token_ids": llm.tokenizer.encode_chat(p["messages"]),
                "prompt": llm.tokenizer.apply_chat_template(p["messages"]),
            }
        elif isinstance(p, dict) and "prompt" in p and "prompt_token_ids" not in p:
            p = p["prompt"]
        elif not isinstance(p, str | dict):
            raise SystemExit(f"prompt {i} must be a string or an object, got {p!r}")
        engine_prompts.append(p)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=FLAGS.max_tokens,
        min_tokens=FLAGS.min_tokens,
        ignore_eos=FLAGS.ignore_eos,
    )
    t0 = time.perf_counter()
    results = llm.generate(engine_prompts, params)
    elapsed = time.perf_counter() - t0
    to_file = FLAGS.output is not None
    with open(FLAGS.output, "w") if to_file else contextlib.nullcontext(sys.stdout) as out:
        for r in results:
            c = r.outputs[0]
            record = {
                "prompt": r.prompt,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    logging.info(
        "%d prompts, %d tokens generated in %.2fs (%.1f tokens/s)",
        len(results),
        generated,
        elapsed,
        generated / elapsed,
    )
