"""kvjax: functional pure-state paged-KV LLM inference in JAX and Pallas."""
from kvjax.api import Model, forward, generate, load_checkpoint
from kvjax.config import PRESETS, ModelConfig, get_preset
from kvjax.engine import Engine
from kvjax.generation import GenerateResult
from kvjax.tokenizer import ByteTokenizer

__all__ = ["Model", "ModelConfig", "PRESETS", "get_preset", "load_checkpoint", "forward",
           "generate", "GenerateResult", "ByteTokenizer", "Engine"]
