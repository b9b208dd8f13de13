"""Model definitions (Flax NNX) and the registry keyed by HF architecture name.

The registry is imported lazily, so `models.config` (the architecture's
configuration, which the engine's host-side config builds on) imports no JAX.
"""

__all__ = ["get_model_class", "register", "supported_architectures"]


def __getattr__(name: str):
    if name in __all__:
        from models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
