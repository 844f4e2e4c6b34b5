"""Tiny random HF transformers models, saved with save_pretrained: the parity oracle."""
from __future__ import annotations

import torch
import transformers

# Random init with a wide std so greedy argmax margins dwarf float32 rounding.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None, pad_token_id=0,
               attn_implementation="eager")

FAMILIES = {
    # GQA 4/2 with Llama-3.1 rope scaling.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
    # Sliding window shorter than the test sequences; MQA.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(
        num_key_value_heads=1, sliding_window=12, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k norm with head_dim independent of hidden_size / heads.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        num_key_value_heads=2, head_dim=32)),
}


def save_tiny(family: str, directory: str, seed: int = 0):
  """Build, save and return the HF model of `family` in eval mode."""
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**_COMMON, **extra)).eval()
  model.save_pretrained(directory)
  return model
