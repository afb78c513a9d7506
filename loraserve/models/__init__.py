"""Base-model loading and our own Llama-family forward over the paged KV cache."""

from loraserve.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
