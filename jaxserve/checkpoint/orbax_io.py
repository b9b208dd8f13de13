"""Orbax checkpoints of a model's weights: a directory that starts a sharded engine fast.

`convert(hf_dir, out_dir)` loads a Hugging Face model and writes its parameters
with orbax (tensorstore, OCDBT) under `out_dir/orbax`, in the model's own layout
(no transposes on loading) and the serving dtype, beside a copy of every other
file of the HF directory (config, tokenizer, generation config, chat template), so
`out_dir` is a complete model directory. `restore(out_dir, ...)` builds the model
abstractly and restores each array straight into its target sharding: each
device's shard is read from the files into that device, once (`tests/
orbax_check.py` measures the bytes read).

`convert(quantization="int8")` stores the quantized model's arrays (int8 kernels and
embedding, their scales) and marks config.json's `quantization_config` (quant_method
"jaxserve_int8"), so `ModelConfig.quantization` knows the model is int8 before any
weight is read; restoring builds the quantized model's layout and reads the int8
arrays as they are (a quarter of a float32 checkpoint's bytes). `quantization="int4"`
likewise ("jaxserve_int4", with its `group_size`): the projections' int4 codes (two a
byte in the files too), their scales per group, the embedding and LM head int8. The
group sizes are not read back: restoring quantizes the abstract model again, which
gives each linear the same group, and refuses arrays of other shapes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint.hf import _path_of, abstract_model, load_hf_model
from jaxserve.distributed import meshes
from models.config import STORED_QUANTIZATIONS, ModelConfig, normalize_dtype
from models.int4 import INT4_GROUP_SIZE
from models.quantize import quantize_weights

logger = logging.getLogger(__name__)

ARRAYS_DIR = "orbax"  # the orbax checkpoint inside a converted model directory
MARKER = "jaxserve_checkpoint.json"  # what the conversion wrote, and that it completed
# 2 (2026-11-24): int8 linear kernels stored [out, in], as the CPU kernel reads them;
# 1: [in, out]. Unquantized arrays are the same in both, so 1 still reads without int8.
FORMAT_VERSION = 2
# Each array is stored in about STORAGE_SPLITS chunks (orbax splits the largest
# dimension first: the vocabulary, the MLP's hidden size, the heads), of at most
# CHUNK_BYTES and at least MIN_CHUNK_BYTES: a device restoring its shard reads the
# chunks that cover it, not the whole array. With one chunk per array, every device of
# a column-split weight read all of it (1.3-1.8x the checkpoint's bytes with TP 4-8
# on the demo model, depending on tensorstore's cache; ~1.0-1.1x with the splits).
CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 16 << 10
STORAGE_SPLITS = 8
# quantization -> the quant_method written into config.json (see models.config)
QUANTIZED_METHODS = {q: method for method, q in STORED_QUANTIZATIONS.items()}
_SKIPPED = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".msgpack")


def _chunk_bytes(nbytes: int) -> int:
    """The chunk size to store an array of `nbytes` in (see STORAGE_SPLITS)."""
    return max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, nbytes // STORAGE_SPLITS))


class _DropMessages(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def is_orbax_dir(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, MARKER))


def _flat_params(state: nnx.State) -> dict[str, object]:
    """{'model.layers.0.self_attn.q_proj.kernel': leaf, ...}: the parameter paths."""
    return {
        ".".join(map(str, _path_of(path))): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    }


def convert(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
) -> str:
    """Writes `hf_dir`'s model as an orbax model directory `out_dir` (its weights
    quantized with `quantization`, if given); returns its path."""
    if quantization is not None and quantization not in QUANTIZED_METHODS:
        raise ValueError(
            f"quantization must be one of {sorted(QUANTIZED_METHODS)} or None, got {quantization!r}"
        )
    dtype = normalize_dtype(dtype)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"output {out_dir!r} exists and is not empty")
    import orbax.checkpoint as ocp

    config = ModelConfig.from_pretrained(hf_dir)
    if config.quantization is not None:
        raise ValueError(f"{hf_dir!r} is stored quantized already ({config.quantization})")
    model = load_hf_model(hf_dir, config, dtype=dtype)
    if quantization is not None:
        model = quantize_weights(model, quantization)
    arrays = _flat_params(nnx.state(model))
    os.makedirs(out_dir, exist_ok=True)
    for name in sorted(os.listdir(hf_dir)):
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src) and not name.endswith(_SKIPPED):
            shutil.copy2(src, os.path.join(out_dir, name))
    if quantization is not None:  # config.json says how the weights are stored
        with open(os.path.join(out_dir, "config.json")) as f:
            hf = json.load(f)
        hf["quantization_config"] = {"quant_method": QUANTIZED_METHODS[quantization]}
        if quantization == "int4":  # (for readers: linears of other sizes take a divisor)
            hf["quantization_config"]["group_size"] = INT4_GROUP_SIZE
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
    save_args = {k: ocp.SaveArgs(chunk_byte_size=_chunk_bytes(x.nbytes)) for k, x in arrays.items()}
    # orbax warns, once per array, about chunks under 1 MiB: small arrays get them on
    # purpose (STORAGE_SPLITS), so those warnings are dropped.
    quiet = _DropMessages("target_byte_size too small")
    logging.getLogger("absl").addFilter(quiet)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            path = os.path.abspath(os.path.join(out_dir, ARRAYS_DIR))
            ckptr.save(path, arrays, save_args=save_args)
    finally:
        logging.getLogger("absl").removeFilter(quiet)
    marker = dict(
        format_version=FORMAT_VERSION,
        source=os.path.abspath(hf_dir),
        dtype=dtype,
        quantization=quantization,
        num_arrays=len(arrays),
        bytes=meshes.total_bytes(arrays),  # (int4: half a byte a value, not `nbytes`)
    )
    with open(os.path.join(out_dir, MARKER), "w") as f:  # last: the directory is complete
        json.dump(marker, f, indent=2)
    return out_dir


def restore(
    model_dir: str,
    config: ModelConfig,
    *,
    dtype: str = "float32",
    attention_backend: str = "reference",
    mesh: Mesh | None = None,
) -> nnx.Module:
    """The model of an orbax model directory, each array restored into its sharding
    on `mesh` (one device without) and cast to `dtype` on reading."""
    import orbax.checkpoint as ocp

    with open(os.path.join(model_dir, MARKER)) as f:
        marker = json.load(f)
    version = marker.get("format_version")
    if version != FORMAT_VERSION and not (version == 1 and marker.get("quantization") is None):
        raise ValueError(
            f"{model_dir!r} holds a jaxserve orbax checkpoint of format {version!r}"
            f"{' with int8 weights' if marker.get('quantization') else ''}; this jaxserve "
            f"reads format {FORMAT_VERSION} (and 1 without quantization): convert the "
            "source model again with `jaxserve convert`"
        )
    if marker.get("quantization") != config.quantization:
        raise ValueError(
            f"{model_dir!r}: its arrays are stored with quantization "
            f"{marker.get('quantization')!r}, its config.json says {config.quantization!r}"
        )
    graphdef, abstract = nnx.split(
        abstract_model(
            config,
            dtype=dtype,
            attention_backend=attention_backend,
            quantization=config.quantization,
        )
    )
    # Each array in its own serving dtype (the compute dtype; int8 / int4 for quantized
    # weights).
    if mesh is None:
        targets = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
    else:
        targets = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract,
            meshes.state_shardings(abstract, mesh),
        )
    flat = _flat_params(targets)
    path = os.path.abspath(os.path.join(model_dir, ARRAYS_DIR))
    stored = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    missing, extra = sorted(set(flat) - set(stored)), sorted(set(stored) - set(flat))
    if missing or extra:
        raise ValueError(
            f"orbax checkpoint {path!r} does not match {config.architecture}'s parameters: "
            f"missing {missing[:5]}, unexpected {extra[:5]} (does config.json match?)"
        )
    for name, target in flat.items():
        if tuple(stored[name].shape) != target.shape:
            raise ValueError(
                f"array {name!r} has shape {tuple(stored[name].shape)}, the model expects "
                f"{target.shape} (does config.json match the weights?)"
            )
    if mesh is None:  # one device: through host memory, uncommitted (as the HF loader)
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype) for k, x in flat.items()}
        with ocp.PyTreeCheckpointer() as ckptr:
            host = ckptr.restore(path, restore_args=args)
        arrays = {k: jnp.asarray(x) for k, x in host.items()}
    else:
        with ocp.StandardCheckpointer() as ckptr:
            arrays = ckptr.restore(path, flat)
    leaves = [arrays[name] for name in _flat_params(targets)]
    state = jax.tree.unflatten(jax.tree.structure(targets), leaves)
    return nnx.merge(graphdef, state)
