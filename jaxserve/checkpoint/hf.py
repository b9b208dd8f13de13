"""Loading a Hugging Face model directory straight into a model's state.

The model is built abstractly (`nnx.eval_shape`: no weights allocated), then each
parameter is read from the safetensors files by the name the model class gives
(`checkpoint_key`), checked for shape, cast to the serving dtype and placed with
its sharding. Single files and sharded checkpoints (`model.safetensors.index.json`)
are both read; bf16, fp16 and fp32 tensors are all accepted. A name with `{}`
(an MoE layer's stacked experts) is one tensor per index of the parameter's
first axis, stacked on reading and split on saving.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.flax import save_file

from jaxserve.checkpoint.quantized import (
    RAW_DTYPES,
    checkpoint_layers,
    checkpoint_reader,
    module_name,
    place,
    read_raw,
)
from jaxserve.distributed import meshes
from jaxserve.quantized.served import checkpoint_format
from models import get_model_class
from models.config import ModelConfig
from models.fp8 import Fp8Linear
from models.int4 import Int4Linear
from models.quantize import quantize_weights

logger = logging.getLogger(__name__)

# Tensors a checkpoint may hold that a model has no parameter for, by design.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_files(model_dir: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(model_dir, file) for name, file in weight_map.items()}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {model_dir!r}")
    names = {}
    for file in files:
        with safe_open(file, framework="flax") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def ignored_tensor(name: str, config: ModelConfig) -> bool:
    """Whether a checkpoint tensor is one a model has no parameter for, by design (the
    rotary tables some checkpoints keep; a tied LM head, which is the embedding)."""
    return name.endswith(_IGNORED_SUFFIXES) or (
        config.tie_word_embeddings and name == "lm_head.weight"
    )


def tensor_names(cls, tree_path, shape: tuple[int, ...]) -> tuple[list[str], bool, bool]:
    """The checkpoint tensors of the parameter at `tree_path` (of `shape`), by the
    model class's `checkpoint_key`: one name, or one per index of the first axis (a
    name with `{}`: stacked experts); whether each is stored transposed (HF stores
    linears [out, in]); and whether they are stacked."""
    name, transpose = cls.checkpoint_key(_path_of(tree_path))
    if "{}" in name:
        return [name.format(i) for i in range(shape[0])], transpose, True
    return [name], transpose, False


def _path_of(tree_path) -> tuple:
    """('model', 'layers', 0, 'mlp', ...) from a jax tree path into an nnx.State."""
    return tuple(getattr(k, "key", None) for k in tree_path if hasattr(k, "key"))


def _read_sharded(slices, leaf, sharding, *, stacked: bool, transpose: bool) -> jax.Array:
    """The parameter `leaf` from safetensors slices, each device's shard read from the
    file straight into that device (`jax.make_array_from_callback`): no device (nor
    the host) holds the whole tensor when it is sharded. Devices whose shards are the
    same (replicated dimensions) share one read."""
    dtype = np.dtype(leaf.dtype)
    reads: dict[tuple, np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop) for s in index)
        if key not in reads:
            parts = [slices[r] for r in range(leaf.shape[0])[index[0]]] if stacked else slices
            inner = index[1:] if stacked else index
            inner = inner[::-1] if transpose else inner  # HF stores linears [out, in]
            xs = [part[inner].T if transpose else part[inner] for part in parts]
            x = np.stack(xs) if stacked else xs[0]
            reads[key] = x.astype(dtype, copy=False)
        return reads[key]

    if sharding is None:  # one device: uncommitted, as the KV caches and step inputs
        return jnp.asarray(read(tuple(slice(None) for _ in leaf.shape)))
    return jax.make_array_from_callback(leaf.shape, sharding, read, dtype=dtype)


def abstract_model(
    config: ModelConfig, *, dtype: str, attention_backend: str, quantization: str | None = None
) -> nnx.Module:
    """The model with ShapeDtypeStructs for weights: nothing allocated (with
    `quantization`, the quantized model's weights; a 4-bit or fp8 checkpoint's model
    (`checkpoint_format`) has its layers whatever `quantization` says)."""
    cls = get_model_class(config.architecture)

    def build():
        model = cls(
            config, dtype=jnp.dtype(dtype), attention_backend=attention_backend, rngs=nnx.Rngs(0)
        )
        fmt = checkpoint_format(config)
        if fmt is not None:
            return checkpoint_layers(model, fmt)
        return quantize_weights(model, quantization) if quantization else model

    return nnx.eval_shape(build)


def load_hf_model(
    model_dir: str,
    config: ModelConfig,
    *,
    dtype: str = "float32",
    attention_backend: str = "reference",
    mesh: Mesh | None = None,
) -> nnx.Module:
    """Builds `config`'s model with the weights in `model_dir`, in `dtype`.

    With a mesh, each device reads its own shard of each parameter from the files
    (`_read_sharded`), so no device ever holds the whole model unsharded.
    """
    cls = get_model_class(config.architecture)
    model = abstract_model(config, dtype=dtype, attention_backend=attention_backend)
    # A 4-bit or fp8 checkpoint's linears: path -> (module name, kernel shape [N, K]).
    quantized = {
        path: (module_name(cls, path), layer.kernel.shape)
        for path, layer in nnx.iter_modules(model)
        if isinstance(layer, (Int4Linear, Fp8Linear))
    }
    graphdef, abstract = nnx.split(model)
    shardings = meshes.state_shardings(abstract, mesh) if mesh is not None else None
    files = _tensor_files(model_dir)
    used: set[str] = set()

    with contextlib.ExitStack() as stack:
        handles: dict[str, object] = {}

        def open_slice(name: str):
            if name not in files:
                raise ValueError(f"checkpoint in {model_dir!r} has no tensor {name!r}")
            used.add(name)
            file = files[name]
            if file not in handles:
                # numpy: slices are read into host memory, never onto a device.
                handles[file] = stack.enter_context(safe_open(file, framework="numpy"))
            return handles[file].get_slice(name)

        def read_whole(name: str) -> np.ndarray | None:
            """A quantized linear's tensor, None where the checkpoint has none; fp8
            tensors from their bytes (safetensors' numpy reader has no fp8)."""
            if name not in files:
                return None
            part = open_slice(name)
            return read_raw(files[name], name) if part.get_dtype() in RAW_DTYPES else part[:]

        reader = quantized and checkpoint_reader(checkpoint_format(config), read_whole)

        def load(tree_path, leaf, sharding=None):
            *module, attr = _path_of(tree_path)
            if tuple(module) in quantized and attr != "bias":  # the rest as it was
                name, shape = quantized[tuple(module)]
                try:
                    return place(reader(name, shape, attr), leaf, sharding)
                except ValueError as e:
                    raise ValueError(f"{model_dir!r}: {name}.{attr}: {e}") from None
            parts, transpose, stacked = tensor_names(cls, tree_path, leaf.shape)
            name = parts[0]
            slices = [open_slice(part) for part in parts]
            shape = tuple(slices[0].get_shape())
            shape = shape[::-1] if transpose else shape  # HF stores linears [out, in]
            shape = (len(parts), *shape) if stacked else shape
            if shape != leaf.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {shape}, the model expects {leaf.shape} "
                    "(does config.json match the weights?)"
                )
            return _read_sharded(slices, leaf, sharding, stacked=stacked, transpose=transpose)

        if shardings is None:
            state = jax.tree.map_with_path(load, abstract)
        else:
            state = jax.tree.map_with_path(load, abstract, shardings)

    unused = sorted(n for n in set(files) - used if not ignored_tensor(n, config))
    if unused:
        logger.warning(
            "ignored %d checkpoint tensors the model does not use: %s",
            len(unused),
            ", ".join(unused[:8]),
        )
    return nnx.merge(graphdef, state)


def save_weights(model: nnx.Module, model_dir: str, *, dtype: str | None = None) -> str:
    """Writes the model's parameters as `model.safetensors` under HF tensor names.

    The inverse of `load_model`: names and layouts come from the model class's
    `checkpoint_key`, so transformers loads the file. Returns the file's path.
    """
    cls = type(model)
    tensors = {}
    for tree_path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name, transpose = cls.checkpoint_key(_path_of(tree_path))
        parts = [(name.format(i), x[i]) for i in range(x.shape[0])] if "{}" in name else [(name, x)]
        for part_name, part in parts:
            part = part.T if transpose else part
            tensors[part_name] = jnp.asarray(part, dtype) if dtype else jnp.asarray(part)
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)  # safetensors creates the file private; it is meant to be shared
    return path
