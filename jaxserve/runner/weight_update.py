"""A runner's weights: loaded into their serving form, and new ones converted to it.

A runner holds its model's weights as a flat list (`ModelDef.split`) in the serving
form: the float model's parameters in the serving dtype, quantized to int8 with
`quantization`, with linears stored [out, in] for bfloat16 on the CPU (`store_rows`),
each array placed as the step programs were compiled for it. `load_serving_model`
builds that form from `model_dir` and says which transforms it applied
(`ServingForm`); `WeightConverter` turns new weights into exactly the same form --
same tree, shapes, dtypes, shardings, and on one device the same committedness (JAX
compiles a committed argument as another program) -- so that swapping them in
compiles no step program again (`ModelRunner.swap_weights`; a cast, a transpose,
int8 quantization or re-sharding a one-device array onto a mesh runs JAX's own small
programs, each compiled once per shape).

New weights come as the float model's parameters (never in the serving form: int8
weights are quantized again from them, as loading does), in one of three shapes:
  - a pytree of the model's state (`nnx.state(model)` of the model class built
    without quantization, or its nested dict form, `State.to_pure_dict()`);
  - a flat mapping of Hugging Face tensor names ('model.layers.0.self_attn.q_proj.
    weight', [out, in] as HF stores linears), named by the checkpoint loader's
    mapping (`checkpoint.hf.tensor_names`; the tensors it ignores are ignored);
  - a model directory, Hugging Face safetensors or orbax (`jaxserve convert`), read
    by the checkpoint loaders, each device's shard straight onto that device.
Dtypes: any floating-point array is cast to the serving dtype (a trainer's float32
into a bfloat16 engine is the common case); integer, bool and complex arrays are
refused, as are wrong shapes and missing or extra names. An array already placed as
the runner's (same sharding and committedness) and of its dtype is adopted as it
is, without a copy; any other is copied onto the runner's placement.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, Sharding
from safetensors import SafetensorError

from jaxserve.checkpoint import abstract_model, load_model
from jaxserve.checkpoint.hf import ignored_tensor, tensor_names
from jaxserve.config import EngineConfig
from jaxserve.distributed import meshes
from jaxserve.runner import lora_io
from jaxserve.runner.step import ModelDef
from models import get_model_class
from models.config import ModelConfig
from models.layers import store_rows, without_cpu_kernels
from models.quantize import quantize_weights
from pallas_kernels.cpu import features as cpu_features
from pallas_kernels.cpu import library as cpu_library

logger = logging.getLogger("jaxserve.runner.model_runner")  # (where loading always logged)

MULTI_HOST = (
    "update_weights is not supported on a multi-host engine: the other processes' "
    "weights would not change"
)


def refusal(config: EngineConfig, compile_device, drafter) -> str | None:
    """Why this runner's weights cannot be updated, or None."""
    if compile_device is not None:
        return "update_weights: this engine only compiles for a target that is not here"
    if drafter is not None:
        return (
            f"update_weights: speculative_config.model={config.speculative.model!r} is a "
            "draft model, and its weights are not updated (its drafts would come from the "
            "old policy); serve without the draft model to update weights"
        )
    if config.lora.enable_lora:
        return (
            "update_weights with enable_lora: the adapters' projections wrap the base "
            "weights, and updating them under the adapters is not supported yet; serve "
            "without enable_lora to update weights"
        )
    return None


@dataclasses.dataclass(frozen=True)
class ServingForm:
    """How a runner's weights derive from the float model's parameters."""

    quantization: str | None  # "int8": quantized from the float weights
    rows: bool  # linears stored [out, in] (`models.layers.store_rows`)
    cpu_kernels: bool = True  # the config's `native_cpu_kernels`

    def apply(self, model: nnx.Module) -> nnx.Module:
        """The float model (weights placed) -> the serving model, in place."""
        if self.quantization is not None:
            model = quantize_weights(model, self.quantization)
        return self.arrange(model)

    def arrange(self, model: nnx.Module) -> nnx.Module:
        """A model in the served quantization -> the serving model, in place: its
        linears' layout, and which matmuls it leaves to XLA."""
        if self.rows:
            model = store_rows(model)
        return model if self.cpu_kernels else without_cpu_kernels(model)


def load_serving_model(
    config: EngineConfig, mesh: Mesh | None, compile_device
) -> tuple[nnx.Module, ServingForm]:
    """The model with its weights placed on `mesh` (shapes only for a compile-only
    `compile_device`), and the form they are in. On the CPU: warns about a slow
    dtype, and builds the C++ kernels that the CPU attention backend and decode
    steps' int8 / bfloat16 matmuls call (without them, or with native_cpu_kernels
    off, XLA's slower formulations)."""
    on_cpu = compile_device is None and jax.default_backend() == "cpu"
    if on_cpu and not cpu_features.fast_dtype(config.dtype):
        logger.warning(
            "dtype=%s is slow on this CPU: XLA:CPU runs its matmuls several times "
            "slower than float32 (bfloat16 is fast with AMX or AVX512-BF16); "
            "dtype=float32 is the fast one",
            config.dtype,
        )
    if on_cpu:
        # Built once per user and CPU.
        cpu_library.prepare(enabled=config.native_cpu_kernels, cache_dir=config.native_kernels_dir)
    model = load_model(
        config.model_dir,
        config.model,
        dtype=config.dtype,
        attention_backend=config.attention_backend,
        quantization=config.quantization,
        mesh=mesh,
        compile_only=compile_device,
    )
    # bfloat16 on the CPU: decode steps' matmuls through the CPU kernel.
    rows = (
        on_cpu
        and config.dtype == "bfloat16"
        and config.quantization is None
        and (mesh is None or mesh.devices.size == 1)
        and config.native_cpu_kernels
        and cpu_library.is_loaded()
    )
    form = ServingForm(config.quantization, rows, config.native_cpu_kernels)
    model = form.arrange(model)
    if config.lora.enable_lora:  # the adapters' slot-stacked matrices beside the weights
        model = lora_io.add_adapters(model, config, mesh, compile_device)
    return model, form


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where an array of the runner's lives: its sharding, and whether it is committed
    (one device's weights are not: loaded with jnp.asarray, as the KV caches are)."""

    sharding: Sharding
    committed: bool


class WeightConverter:
    """New weights -> a flat list in exactly the form of the runner's `weights`
    (see the module docstring). Raises ValueError naming the first mismatch, having
    changed nothing the runner holds."""

    def __init__(
        self,
        config: EngineConfig,
        mesh: Mesh | None,
        model_def: ModelDef,
        weights: list[jax.Array],
        form: ServingForm,
    ):
        self.config, self.mesh, self.model_def, self.form = config, mesh, model_def, form
        self.targets = [(w.shape, w.dtype, _Placement(w.sharding, w.committed)) for w in weights]
        served = jax.tree_util.tree_leaves_with_path(model_def.state(weights))
        self.target_names = [_dotted(path) for path, _ in served]
        cls = get_model_class(config.model.architecture)
        # The float model, whose parameters an update gives.
        self.graphdef, abstract = nnx.split(
            abstract_model(
                config.model, dtype=config.dtype, attention_backend=config.attention_backend
            )
        )
        paths_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(abstract)
        self.names = [_dotted(path) for path, _ in paths_leaves]
        self.leaves = [leaf for _, leaf in paths_leaves]
        self.hf = [tensor_names(cls, path, leaf.shape) for path, leaf in paths_leaves]
        # Served as they are (no quantization, no rows layout): the same tree.
        self.as_is = (
            form.quantization is None and not form.rows and self.treedef == model_def.treedef
        )
        if mesh is not None:
            shardings = jax.tree.leaves(meshes.state_shardings(abstract, mesh))
            self.placements = [_Placement(s, True) for s in shardings]
        else:  # one device: where (and how) the runner's weights are
            self.placements = [dataclasses.replace(self.targets[0][2], committed=False)] * len(
                self.leaves
            )

    # ------------------------------------------------------------------ sources

    def from_params(self, params) -> list[jax.Array]:
        """A pytree of the float model's state, or a flat mapping of HF tensors."""
        if _is_hf_mapping(params):
            arrays = self._from_hf(params)
        else:
            given = {_dotted(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
            _check_names("params", self.names, given)
            arrays = []
            for name, leaf in zip(self.names, self.leaves, strict=True):
                x = _array(given[name])
                _check(f"params[{name!r}]", x.shape, x.dtype, leaf.shape, leaf.dtype)
                arrays.append(x)
        placed = [
            _place(_cast(x, leaf.dtype), p)
            for x, leaf, p in zip(arrays, self.leaves, self.placements, strict=True)
        ]
        if self.as_is:
            return self._serving(placed)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, placed))
        model_def, weights = ModelDef.split(self.form.apply(model))
        return self._serving(weights, model_def)

    def _from_hf(self, tensors: Mapping[str, object]) -> list[jax.Array]:
        """The float model's leaves from HF-named tensors (transposed, experts stacked)."""
        expected = [n for names, _, _ in self.hf for n in names]
        known, model = set(expected), self.config.model
        given = {k: v for k, v in tensors.items() if k in known or not ignored_tensor(k, model)}
        _check_names("params", expected, given)
        arrays = []
        for (names, transpose, stacked), leaf in zip(self.hf, self.leaves, strict=True):
            shape = leaf.shape[1:] if stacked else leaf.shape
            shape = tuple(reversed(shape)) if transpose else shape
            parts = []
            for name in names:
                x = _array(tensors[name])
                _check(f"params[{name!r}]", x.shape, x.dtype, shape, leaf.dtype)
                parts.append(x.T if transpose else x)
            if not stacked:
                arrays.append(parts[0])
            else:
                stack = jnp.stack if isinstance(parts[0], jax.Array) else np.stack
                arrays.append(stack(parts))
        return arrays

    def from_path(self, path: str) -> list[jax.Array]:
        """A Hugging Face safetensors or orbax model directory, read as loading does, of
        the served model (its config.json's architecture the same: `_same_model`). A
        directory that cannot be read is a ValueError naming it too."""
        if not isinstance(path, str) or not os.path.isdir(path):
            raise ValueError(f"path must be a model directory, got {path!r}")
        try:
            found = ModelConfig.from_pretrained(path)
            _same_model(path, found, self.config.model)
            if found.quantization not in (None, self.form.quantization):
                raise ValueError(
                    f"path {path!r} stores {found.quantization} weights; this engine serves "
                    f"quantization={self.form.quantization!r}"
                )
            model = load_model(
                path,
                dataclasses.replace(self.config.model, quantization=found.quantization),
                dtype=self.config.dtype,
                attention_backend=self.config.attention_backend,
                quantization=self.form.quantization,
                mesh=self.mesh,
            )
        except (OSError, SafetensorError) as e:  # (missing files, a truncated one)
            raise ValueError(f"path {path!r}: {e}") from e
        model = self.form.arrange(model)
        model_def, weights = ModelDef.split(model)
        return self._serving(weights, model_def)

    # ------------------------------------------------------------------ the form

    def _serving(self, weights: list[jax.Array], model_def: ModelDef | None = None):
        """`weights` (the serving model's, of `model_def`'s tree; None: the runner's)
        placed exactly as the runner's are. A mismatch here is the served model's, not
        the caller's names: a directory whose config.json does not match, say."""
        if model_def is not None and model_def.treedef != self.model_def.treedef:
            raise ValueError(
                "the new weights' parameter tree is not the served model's (does the "
                "directory's config.json match the served model?)"
            )
        out = []
        for x, name, (shape, dtype, placement) in zip(
            weights, self.target_names, self.targets, strict=True
        ):
            if x.shape != shape or x.dtype != dtype:
                raise ValueError(
                    f"weight {name!r} would be {x.dtype}{list(x.shape)}; the engine serves "
                    f"{dtype}{list(shape)} (does the checkpoint match the served model?)"
                )
            out.append(_place(x, placement))
        return out


# What a checkpoint's config.json may say otherwise than the served model's: how it was
# stored, its special tokens and context length. The rest describes the architecture,
# which an update keeps (an extra layer's tensors, say, would be ignored unread).
_MAY_DIFFER = ("max_position_embeddings", "bos_token_id", "eos_token_ids", "checkpoint_dtype")


def _same_model(path: str, found: ModelConfig, mine: ModelConfig) -> None:
    """Raises ValueError naming `path` and the first field of `found` (its config.json)
    that differs from the served model's `mine`."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in (*_MAY_DIFFER, "quantization"):  # (quantization: checked apart)
            continue
        theirs, ours = getattr(found, field.name), getattr(mine, field.name)
        if theirs != ours:
            raise ValueError(
                f"path {path!r}: config.json has {field.name}={theirs!r}, the served model "
                f"{ours!r}: an update changes the weights, not the architecture"
            )


def _dotted(tree_path) -> str:
    """'model.layers.0.mlp.down_proj.kernel' from a tree path into a state or a nested
    dict (an nnx Variable's own `.value` step left out)."""
    parts = []
    for k in tree_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            parts.append(k.name)
    return ".".join(parts)


def _is_hf_mapping(params) -> bool:
    """A flat mapping of tensor names to arrays (not an nnx.State nor a nested dict)."""
    return (
        isinstance(params, Mapping)
        and not isinstance(params, nnx.State)
        and bool(params)
        and all(isinstance(k, str) for k in params)
        and not any(isinstance(v, Mapping) for v in params.values())
    )


def _check_names(what: str, expected: list[str], given: Mapping[str, object]) -> None:
    """Missing or unknown names: the first of each named (a misspelt name is both)."""
    known = set(expected)
    missing = [n for n in expected if n not in given]
    extra = sorted(n for n in given if n not in known)
    if missing:
        also = f"; it has {extra[0]!r}, which the model does not have" if extra else ""
        raise ValueError(
            f"{what} has no {missing[0]!r} ({len(missing)} of the model's "
            f"{len(expected)} parameters missing{also})"
        )
    if extra:
        raise ValueError(
            f"{what} has {extra[0]!r}, which the model does not have "
            f"({len(extra)} unknown names; the model's are like {expected[0]!r})"
        )


def _array(x):
    """A jax or numpy array as it is; anything else (a list) as numpy."""
    return x if isinstance(x, jax.Array | np.ndarray) else np.asarray(x)


def _check(where: str, shape, dtype, want_shape, want_dtype) -> None:
    """Shapes must match; a floating-point dtype may differ (it is cast)."""
    if tuple(shape) != tuple(want_shape):
        raise ValueError(f"{where} has shape {tuple(shape)}, the model expects {tuple(want_shape)}")
    floats = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(want_dtype, jnp.floating)
    if dtype != want_dtype and not floats:
        raise ValueError(
            f"{where} has dtype {dtype}, the model expects {want_dtype} (floating-point "
            "arrays are cast to it; integer, bool and complex ones are refused)"
        )


def _cast(x, dtype):
    """On the host for numpy (less to move), on its devices for a jax array."""
    return x if x.dtype == dtype else x.astype(dtype)


def _place(x, placement: _Placement) -> jax.Array:
    """`x` placed as `placement`: as it is (no copy) if it is already."""
    if (
        isinstance(x, jax.Array)
        and x.sharding == placement.sharding
        and x.committed == placement.committed
    ):
        return x
    if placement.committed:
        return jax.device_put(x, placement.sharding)
    # One device, uncommitted. JAX has no public way to uncommit an array in place: a
    # committed one goes through the host.
    if isinstance(x, jax.Array):
        x = np.asarray(x)
    (device,) = placement.sharding.device_set
    with jax.default_device(device):  # (jnp.asarray would compile a program per shape)
        return jax.device_put(x)


__all__ = ["ServingForm", "WeightConverter", "load_serving_model"]
