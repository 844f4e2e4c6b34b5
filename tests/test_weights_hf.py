"""HF checkpoint loading: sharded index, dtype conversion, errors that name the problem."""
from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax.model.layers import rope_attention_factor, rope_inv_freq
from kvjax.weights.checkpoint import config_from_dict, config_to_dict
from kvjax.weights.hf_config import config_from_hf
from tests import hf_models


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("llama_src"))
  hf_models.save_tiny("llama", directory)
  return directory


def test_sharded_checkpoint_loads_identically(llama_dir, tmp_path):
  hf_model = hf_models.save_tiny("llama", str(tmp_path / "unused"))
  sharded = str(tmp_path / "sharded")
  hf_model.save_pretrained(sharded, max_shard_size="20KB")
  assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
  single = kvjax.load_checkpoint(llama_dir)
  split = kvjax.load_checkpoint(sharded)
  tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
  np.testing.assert_array_equal(np.asarray(kvjax.forward(single, tokens)),
                                np.asarray(kvjax.forward(split, tokens)))


def test_bfloat16_load_keeps_hf_logits_close(llama_dir):
  model = kvjax.load_checkpoint(llama_dir, dtype="bfloat16")
  assert model.params.embed.dtype == jnp.bfloat16
  full = kvjax.load_checkpoint(llama_dir)
  tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
  low = np.asarray(kvjax.forward(model, tokens))
  high = np.asarray(kvjax.forward(full, tokens))
  assert np.abs(low - high).max() < 0.1 * np.abs(high).max()
  assert (low.argmax(-1) == high.argmax(-1)).mean() >= 0.75


def test_missing_tensor_is_named(llama_dir, tmp_path):
  from safetensors.torch import load_file, save_file

  broken = str(tmp_path / "broken")
  shutil.copytree(llama_dir, broken)
  tensors = load_file(os.path.join(broken, "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, os.path.join(broken, "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight is missing"):
    kvjax.load_checkpoint(broken)


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
  other = str(tmp_path / "gpt2ish")
  shutil.copytree(llama_dir, other)
  path = os.path.join(other, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["model_type"] = "gpt2"
  with open(path, "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
    kvjax.load_checkpoint(other)


def test_unsupported_rope_type_is_named():
  with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
    config_from_hf(dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8,
                        rope_scaling={"rope_type": "longrope", "factor": 4.0}))


@pytest.mark.parametrize("rope", [
    # gpt-oss as shipped: the band's ends not rounded
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=64),  # truncate defaults to true
    dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    dict(factor=None, attention_factor=1.25, original_max_position_embeddings=64),
])
def test_yarn_rope_matches_hf(rope):
  from transformers import GptOssConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf_config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=256, num_hidden_layers=2,
                           num_local_experts=8,
                           rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, **rope))
  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
  cfg = config_from_hf(hf_config.to_dict())
  np.testing.assert_allclose(np.asarray(rope_inv_freq(cfg)), inv_freq.numpy(), rtol=1e-6)
  assert rope_attention_factor(cfg) == pytest.approx(attention_factor, rel=1e-12)
  assert config_from_dict(config_to_dict(cfg)) == cfg  # kvjax checkpoints keep the record


def test_qwen2_per_layer_sliding_window_from_flags():
  cfg = config_from_hf(dict(model_type="qwen2", vocab_size=8, hidden_size=8,
                            intermediate_size=8, num_hidden_layers=4, num_attention_heads=2,
                            max_position_embeddings=64, sliding_window=16,
                            use_sliding_window=True, max_window_layers=2))
  assert cfg.layer_windows == (None, None, 16, 16)
  assert [cfg.window_of_layer(i) for i in range(4)] == [None, None, 16, 16]
