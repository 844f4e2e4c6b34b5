"""kvjax: functional pure-state paged-KV LLM inference in JAX and Pallas."""
from kvjax.config import ModelConfig, PRESETS, get_preset

__all__ = ["ModelConfig", "PRESETS", "get_preset"]
