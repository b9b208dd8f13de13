"""`jaxserve convert`: a Hugging Face model directory -> an orbax model directory.

  jaxserve convert --model=HF_DIR --output=DIR [--dtype=bfloat16] [--quantization=int8|int4|fp8]

DIR holds the weights as an orbax checkpoint (DIR/orbax, in the serving dtype and
the model's own layout) and a copy of the directory's config, tokenizer and
generation files, so `jaxserve serve --model=DIR` and `LLM(model=DIR)` load it
like any model directory, restoring each array straight into its sharding.
"""

from __future__ import annotations

import time

from absl import flags

from jaxserve.checkpoint import convert
from jaxserve.llm import resolve_model_dir
from server.cli import logs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Hugging Face model directory (or embedded model name).")
flags.DEFINE_string("output", None, "Directory to write (must not exist, or be empty).")
flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16", "float16"], "Dtype the weights are stored in."
)
flags.DEFINE_string(
    "quantization",
    None,
    "Store the weights quantized: int8 (a quarter of float32's bytes; served as int8) or "
    "int4 (the projections in 4 bits with a scale per 128 inputs, about an eighth; the "
    "embedding and LM head int8; served as int4) or fp8 (the projections e4m3 with a "
    "scale per output channel, the embedding and LM head as they are; served as fp8).",
)
flags.mark_flags_as_required(["model", "output"])


def main(argv) -> None:
    del argv
    logs.configure(fmt="%(asctime)s %(levelname)s %(message)s")
    t0 = time.perf_counter()
    try:
        out = convert(
            resolve_model_dir(FLAGS.model),
            FLAGS.output,
            dtype=FLAGS.dtype,
            quantization=FLAGS.quantization or None,
        )
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"jaxserve convert: {e}") from None
    print(f"wrote {out} in {time.perf_counter() - t0:.1f}s")
