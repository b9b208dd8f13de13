"""`jaxserve preflight`: compile for a TPU or GPU before renting it.

  jaxserve preflight --target=v5e-8 --model=DIR --tensor_parallel_size=8 [engine flags]

Builds the engine for the target's compile-only devices on this machine (no
accelerator needed; `DIR/config.json` is enough, no weights are read) and compiles
every step program the engine would compile there, with the device's own
compilers (Mosaic and XLA:TPU, or Triton and XLA:GPU). Prints per device the
weights, KV pages and tokens, maximum concurrency and the programs' temporary
memory; the program count and compile time; and per decode batch an estimated
step time and tokens/s from the compiled programs' bytes and flops against the
chip's bandwidth and peak, with the bytes beside the minimum a step must move.
A model that does not fit fails, naming what and by how much.

With --output=DIR the compiled programs are written to DIR as a bundle, with a
manifest of what they depend on (target, jax version, code, engine settings);
on the target, `jaxserve serve --compiled=DIR` (or `LLM(compiled=DIR)`) with the
same engine flags loads them instead of compiling. Such a bundle has not yet been
loaded on a real TPU or GPU by this project's tests (deserializing needs the
target's runtime).

Targets: v4-N, v5e-N, v5p-N, v6e-N (TPU; v4/v5p count TensorCores, as Google
names them), h100xN, a100xN. Without --config, the platform's preset
(configs/tpu.toml, configs/gpu.toml) sets the defaults: bfloat16, and 90% of
device memory for weights and KV (kv_cache_memory_fraction=0.9).

Needs the device compilers: `pip install "jaxserve[compile]"` (libtpu and the
CUDA plugin, at jax's version).
"""

from __future__ import annotations

import os

# Compile-only devices of another platform: this process brings up no accelerator
# of its own (the CUDA plugin's failed start would also keep its compile-only
# topology away), and libtpu does not look for a TPU VM's metadata server. Set
# before jax is imported (it reads JAX_PLATFORMS once).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # several compile-only processes at once

from absl import flags

from jaxserve.config import engine_config
from jaxserve.llm import resolve_model_dir
from jaxserve.preflight import preflight
from jaxserve.targets import DEVICE_PRESETS, Target
from models.config import ModelConfig
from server.cli import logs
from server.cli.engine_flags import engine_kwargs

FLAGS = flags.FLAGS
flags.DEFINE_string("target", None, "v5e-8, v6e-4, v5p-8, v4-8, h100x8, a100x4, ...")
flags.DEFINE_list(
    "decode_batches", ["1", "8", "64"], "Decode batch sizes to estimate step times for."
)
flags.DEFINE_string(
    "output", None, "Directory to write the compiled programs to, as a bundle (--compiled)."
)
flags.mark_flags_as_required(["target"])

# LLM(...) arguments that are not the engine's.
_NOT_ENGINE = ("tokenizer", "skip_tokenizer_init", "compiled")


def main(argv) -> None:
    del argv
    logs.configure(fmt="%(asctime)s %(levelname)s %(message)s")
    try:
        target = Target.parse(FLAGS.target)
        if FLAGS.compiled:
            raise ValueError("--compiled loads a bundle; preflight makes one (--output)")
        kw = {k: v for k, v in engine_kwargs().items() if k not in _NOT_ENGINE}
        if not FLAGS.config:
            for name, value in DEVICE_PRESETS[target.platform].items():
                if not FLAGS[name].present:
                    kw[name] = value
        if not FLAGS["tensor_parallel_size"].present and kw["tensor_parallel_size"] == 1:
            kw["tensor_parallel_size"] = target.num_chips  # one engine over the target's chips
        kw["compilation_cache_dir"] = None  # programs for another machine
        model_dir = resolve_model_dir(FLAGS.model)
        spec = kw.get("speculative_config")
        if spec and spec.get("model") is not None:
            kw["speculative_config"] = {**spec, "model": resolve_model_dir(spec["model"])}
        config = engine_config(model_dir, ModelConfig.from_pretrained(model_dir), **kw)
        batches = tuple(int(b) for b in FLAGS.decode_batches)
        report = preflight(config, target, decode_batches=batches, output=FLAGS.output)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        raise SystemExit(f"jaxserve preflight: {e}") from None
    print(report.format())
