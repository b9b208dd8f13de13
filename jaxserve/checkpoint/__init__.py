"""Checkpoint loading: Hugging Face model directories."""

from jaxserve.checkpoint.hf import abstract_model, load_model, save_weights

__all__ = ["abstract_model", "load_model", "save_weights"]
