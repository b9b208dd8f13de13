"""The model registry, keyed by Hugging Face `architectures` names.

A model file in this package decorates its class with `@register("HFArchName")`;
the registry checks the class's interface there, so a model that would not fit
the engine fails at import, not mid-serving. Adding a model is one new file:
`get_model_class` imports every module of the package before it looks up.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from flax import nnx

_REGISTRY: dict[str, type[nnx.Module]] = {}

# Parameter names each method must accept, in order after `self`.
_INTERFACE: dict[str, tuple[str, ...]] = {
    "__init__": ("config", "dtype", "attention_backend", "rngs"),
    "__call__": ("kv_caches", "input_ids", "positions", "attention_metadata"),
    "compute_logits": ("hidden",),
}


def check_interface(cls: Any) -> None:
    """Raises TypeError if `cls` does not have the model interface the engine calls.

    The interface:
      cls(config: ModelConfig, *, dtype, attention_backend: str, rngs: nnx.Rngs)
      model(kv_caches, input_ids [T], positions [T], attention_metadata)
          -> (hidden [T, D], kv_caches)
        (a hybrid KV cache's metadata is a `pallas_kernels.GroupedMetadata`: layer i
        attends with `layer_metadata(attention_metadata, i)`, its group's page table)
      model.compute_logits(hidden [B, D]) -> logits [B, V] float32
      cls.checkpoint_key(path: tuple) -> (hf_tensor_name, transpose: bool)
    """
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise TypeError(f"{cls!r} must be a subclass of flax.nnx.Module")
    for method, names in _INTERFACE.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise TypeError(f"{cls.__name__} lacks method {method}{names}")
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        if tuple(params[: len(names)]) != names:
            raise TypeError(
                f"{cls.__name__}.{method} must take parameters {names}, got {tuple(params)}"
            )
    if not callable(getattr(cls, "checkpoint_key", None)):
        raise TypeError(f"{cls.__name__} lacks classmethod checkpoint_key(path)")


def register(*architectures: str):
    """Class decorator: registers a model under one or more HF architecture names."""
    if not architectures:
        raise ValueError("register() needs at least one architecture name")

    def decorate(cls):
        check_interface(cls)
        for arch in architectures:
            other = _REGISTRY.get(arch)
            if other is not None and other is not cls:
                raise ValueError(
                    f"architecture {arch!r} is registered twice: "
                    f"{other.__name__} and {cls.__name__}"
                )
            _REGISTRY[arch] = cls
        return cls

    return decorate


def _import_all_models() -> None:
    import models

    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"models.{info.name}")


def supported_architectures() -> list[str]:
    _import_all_models()
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[nnx.Module]:
    _import_all_models()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(_REGISTRY)}"
        ) from None
