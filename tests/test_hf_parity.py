"""kvjax vs HF transformers (the oracle) on tiny random Llama/Mistral/Qwen2/Qwen3."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvjax
from tests.hf_models import FAMILIES

FAMILY_NAMES = sorted(FAMILIES)
# Different lengths; the longest exceeds Mistral's 12-token window.
PROMPTS = [[5, 17, 33, 2, 9, 44, 71], [3, 99, 12, 8, 61, 23, 5, 5, 90, 14, 2, 77, 31, 6, 15, 40,
                                       101, 7, 66], [120, 1, 50]]
NEW_TOKENS = 32


def _hf_logits(hf_model, tokens):
  with torch.no_grad():
    return hf_model(torch.tensor(tokens)).logits.numpy()


def _hf_greedy(hf_model, prompt):
  with torch.no_grad():
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_forward_logits_match_hf(hf_pair, family):
  hf_model, model = hf_pair(family)
  tokens = np.array([PROMPTS[1][:16], PROMPTS[1][3:19]], np.int32)
  ours = np.asarray(kvjax.forward(model, tokens))
  theirs = _hf_logits(hf_model, tokens)
  assert ours.shape == theirs.shape
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_loaded_config_reflects_family_features(hf_pair):
  assert hf_pair("llama")[1].config.rope_scaling.factor == 8.0
  assert hf_pair("mistral")[1].config.sliding_window == 12
  assert hf_pair("mistral")[1].config.num_kv_heads == 1
  assert hf_pair("qwen2")[1].config.attention_bias
  assert hf_pair("qwen2")[1].params.lm_head is None  # tied
  assert hf_pair("qwen3")[1].config.qk_norm and hf_pair("qwen3")[1].config.head_dim == 32


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_generate_matches_hf_for_every_cache(hf_pair, family):
  hf_model, model = hf_pair(family)
  expected = [_hf_greedy(hf_model, p) for p in PROMPTS]
  for cache in ("paged", "contiguous", "none"):
    result = kvjax.generate(model, PROMPTS, NEW_TOKENS, cache=cache, page_size=8)
    assert result.tokens == expected, f"{family} cache={cache}"
