"""Model definitions (Flax NNX) and the registry keyed by HF architecture name."""

from models.registry import get_model_class, register, supported_architectures

__all__ = ["get_model_class", "register", "supported_architectures"]
