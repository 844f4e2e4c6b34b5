"""Quantized KV pages through the Engine: the static batch's tokens, prefix hits, errors.

int8 stores one scale per token per head, so a page's values depend on nothing
but its tokens: the Engine (chunked prefill, batching, drafts) must give the
static batch's greedy tokens exactly.  int4 (KIVI) depends on chunking: a query
reads its own incomplete page's earlier keys from the full-precision residual,
or quantized once the same step completes that page, so a different chunking
changes later layers' K/V.  The int4 scenarios use a token budget that never
chunks a prompt, which makes the Engine and the static batch agree again.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.caches import KIVIPagedKVCache, MLAPagedCache, PagedKVCache, copy_cache_pages
from tests import engine_helpers as h

UNCHUNKED = 128  # token budget above the sum of every batch's prompt lengths

# name: (kv_dtype, engine overrides)
SCENARIOS = {
    "int8_chunked": ("int8", {}),
    "int8_verify_mtp_drafts": ("int8", dict(speculative="mtp")),
    "int4_unchunked": ("int4", dict(max_num_batched_tokens=UNCHUNKED)),
}


def _static(prompts, kv_dtype, max_new=h.MAX_NEW):
  """The oracle: the static batch with the same kv_dtype (one prefill, no Engine)."""
  return kvjax.generate(h.mtp_model(), prompts, max_new, page_size=16, kv_dtype=kv_dtype).tokens


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_engine_matches_the_static_batch(name):
  kv_dtype, overrides = SCENARIOS[name]
  batch = h.prompts(4, seed=5)
  eng = h.engine(kv_dtype=kv_dtype, **overrides)
  assert eng.state.cache.k_pages.dtype == jnp.int8
  assert eng.generate(batch, h.MAX_NEW).tokens == _static(batch, kv_dtype)
  h.assert_no_pages_held(eng)


# name: (kv_dtype, prefix_match, token budget, prefix-hit tokens)
HITS = {
    "int8_block": ("int8", "block", 16, 16),
    "int8_token_copies_scales": ("int8", "token", 16, 20),
    "int4_block": ("int4", "block", UNCHUNKED, 16),
}


@pytest.mark.parametrize("name", sorted(HITS))
def test_prefix_hits_give_the_tokens_of_no_prefix_cache(name):
  kv_dtype, match, budget, expected_hit = HITS[name]
  first, second = h.prompts(2, seed=3, shared=20)
  first = first + [7] * (33 - len(first))  # two full blocks get cached
  result = kvjax.generate(h.mtp_model(), [first, second], h.MAX_NEW, kv_dtype=kv_dtype,
                          prefix_cache=False, **{**h.ENGINE_DEFAULTS,
                                                 "max_num_batched_tokens": budget})
  assert result.tokens == _static([first, second], kv_dtype)
  eng = h.engine(kv_dtype=kv_dtype, prefix_match=match, max_num_batched_tokens=budget)
  assert eng.generate([first], h.MAX_NEW).tokens == result.tokens[:1]
  hit = eng.generate([second], h.MAX_NEW)
  assert hit.stats["prefix_hit_tokens"] == expected_hit
  assert hit.tokens == result.tokens[1:]
  h.assert_no_pages_held(eng)


def _numbered(shape):
  return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


def test_copy_moves_every_page_array_and_no_slot_state():
  src, dst = jnp.asarray([1, 2]), jnp.asarray([3, 0])
  int8 = PagedKVCache.create(2, 2, 4, 3, 8, jnp.int8)
  int8 = int8.replace(k_scales=_numbered(int8.k_scales.shape),
                      v_scales=_numbered(int8.v_scales.shape) + 0.5)
  kivi = KIVIPagedKVCache.create(2, 2, 4, 3, 8, num_slots=2, residual_dtype=jnp.float32)
  kivi = kivi.replace(k_scales=_numbered(kivi.k_scales.shape),
                      k_residual=_numbered(kivi.k_residual.shape))
  mla = MLAPagedCache.create(kvjax.get_preset("tiny").replace(
      attention_type="mla", kv_lora_rank=8, qk_rope_head_dim=4), 4, 3, jnp.float32)
  mla = mla.replace(pages=_numbered(mla.pages.shape))
  for cache in (int8, kivi, mla):
    copied = copy_cache_pages(cache, src, dst)
    for name in cache.PAGE_ARRAYS:
      before, after = (np.moveaxis(np.asarray(getattr(c, name)), cache.PAGE_AXIS, 0)
                       for c in (cache, copied))
      np.testing.assert_array_equal(after[[3, 0]], before[[1, 2]], err_msg=name)
      np.testing.assert_array_equal(after[1:3], before[1:3], err_msg=name)
  np.testing.assert_array_equal(copy_cache_pages(kivi, src, dst).k_residual, kivi.k_residual)


# name: (model, engine keywords, error fragment)
BAD = {
    "unknown_dtype": ("tiny", dict(kv_dtype="int3"), "unsupported kv_dtype 'int3'"),
    "int4_pallas": ("tiny", dict(kv_dtype="int4", backend="pallas_reference"),
                    "not supported by attention backend 'pallas_reference'"),
    "int4_speculative": ("mtp", dict(kv_dtype="int4", speculative="mtp"),
                         "kv_dtype 'int4' cannot verify drafts"),
    "int4_token_match": ("tiny", dict(kv_dtype="int4", prefix_match="token"),
                         "kv_dtype 'int4' cannot reuse partial pages"),
    # The check runs before any weight is read: no parameters needed.
    "mla_int8": ("mla", dict(kv_dtype="int8"), "kv_dtype 'int8' is not supported for MLA"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_kv_dtype_is_refused_by_name(tiny_model, name):
  which, kwargs, fragment = BAD[name]
  model = {"tiny": tiny_model, "mtp": h.mtp_model(),
           "mla": kvjax.Model(kvjax.get_preset("deepseek-v2-lite"), None)}[which]
  with pytest.raises(ValueError, match=fragment):
    kvjax.Engine(model, **kwargs)
  if which == "tiny":  # kvjax.generate's Engine path passes kv_dtype through
    with pytest.raises(ValueError, match=fragment):
      kvjax.generate(model, [[5, 6, 7]], 2, max_num_seqs=1, **kwargs)
