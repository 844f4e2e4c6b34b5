"""Checkpoint formats: kvjax-native orbax checkpoints, HF safetensors import, GGUF files."""
