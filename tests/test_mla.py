"""MLA vs HF transformers' DeepseekV2 / DeepseekV3 on tiny dense random models."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import transformers

import kvjax
from kvjax.caches import MLAPagedCache, create_paged_cache
from kvjax.parallel import ledger
from tests.test_attention_variants import BOTH, PROMPT

# Dense: first_k_dense_replace = num_hidden_layers, so no layer is MoE.  Wide init
# so greedy argmax margins dwarf float32 rounding.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
               initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=None,
               pad_token_id=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, attn_implementation="eager")
VARIANTS = {
    # V2: interleaved (complex) rope, full-rank queries.
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                    dict(q_lora_rank=None)),
    # V3: low-rank queries through q_a_layernorm, interleaved rope.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    dict(q_lora_rank=24, rope_interleave=True)),
    # V3 with rotate-half rope: the loader must not permute.
    "deepseek_v3_halves": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                           dict(q_lora_rank=24, rope_interleave=False)),
}
PROMPTS = [[5, 17, 33, 2, 9, 44, 71], [3, 99, 12, 8, 61, 23, 5, 5, 90, 14, 2, 77, 31, 6, 15, 40,
                                       101, 7, 66], [120, 1, 50]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def mla_pair(tmp_path_factory):
  cache = {}

  def get(variant):
    if variant not in cache:
      config_cls, model_cls, extra = VARIANTS[variant]
      torch.manual_seed(0)
      hf_model = model_cls(config_cls(**_COMMON, **extra)).eval()
      directory = str(tmp_path_factory.mktemp(variant))
      hf_model.save_pretrained(directory)
      cache[variant] = (hf_model, kvjax.load_checkpoint(directory), directory)
    return cache[variant]

  return get


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_logits_match_hf(mla_pair, variant):
  hf_model, model, _ = mla_pair(variant)
  assert model.config.attention_type == "mla"
  tokens = np.array([PROMPTS[1][:16], PROMPTS[1][3:19]], np.int32)
  ours = np.asarray(kvjax.forward(model, tokens))
  with torch.no_grad():
    theirs = hf_model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant, caches", [
    ("deepseek_v2", ("paged", "contiguous", "none")), ("deepseek_v3", ("paged",))])
def test_greedy_generate_matches_hf(mla_pair, variant, caches):
  hf_model, model, _ = mla_pair(variant)
  expected = []
  for prompt in PROMPTS:
    with torch.no_grad():
      out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    expected.append(out[0, len(prompt):].tolist())
  for cache in caches:
    assert kvjax.generate(model, PROMPTS, NEW_TOKENS, cache=cache, page_size=8).tokens == \
        expected, cache


def test_paged_cache_holds_only_latent_and_rope_key(mla_pair):
  _, model, _ = mla_pair("deepseek_v2")
  cfg = model.config
  cache = create_paged_cache(cfg, None, num_slots=2, num_pages=5, page_size=8,
                             dtype=np.float32)
  assert isinstance(cache, MLAPagedCache)
  width = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 32 + 8, not 2 * 4 heads * 16
  assert cache.pages.shape == (cfg.num_layers, 5, 8, width)
  assert ledger.kv_values_per_token(cfg) == cfg.num_layers * width


def test_mla_rejects_other_backends(mla_pair):
  _, model, _ = mla_pair("deepseek_v2")
  with pytest.raises(ValueError, match="reference"):
    kvjax.generate(model, PROMPTS[:1], 2, backend="pallas_reference")


def test_moe_checkpoint_is_refused_clearly(mla_pair, tmp_path):
  _, _, directory = mla_pair("deepseek_v2")
  with open(os.path.join(directory, "config.json")) as f:
    hf = json.load(f)
  hf["first_k_dense_replace"] = 1
  from kvjax.weights.hf_config import config_from_hf
  with pytest.raises(ValueError, match="MoE"):
    config_from_hf(hf)


def test_a_variant_runs_on_every_mla_cache_path(mla_pair):
  """Landmark + ALiBi (tests/test_attention_variants.py, whose float64 oracle holds MLA's
  latent attention to each rule) on DeepSeek-V2: paged, contiguous and the Engine with a
  prefix hit give the no-cache greedy, which the variant changes."""
  _, model, _ = mla_pair("deepseek_v2")
  prompts = [PROMPT + list(b"(n - 1)"), PROMPT + list(b"(n - 2)")]
  want = kvjax.generate(model, prompts, 12, cache="none", attention=BOTH).tokens
  assert want != kvjax.generate(model, prompts, 12, cache="none").tokens
  for cache in ("paged", "contiguous"):
    assert kvjax.generate(model, prompts, 12, cache=cache, page_size=8,
                          attention=BOTH).tokens == want, cache
  engine = kvjax.Engine(model, attention=BOTH, page_size=8, max_num_seqs=2, max_model_len=128)
  got = [engine.generate([p], 12).tokens[0] for p in prompts]  # the second one hits
  assert engine.stats().prefix_hit_tokens >= len(PROMPT) - 8
  assert got == want
