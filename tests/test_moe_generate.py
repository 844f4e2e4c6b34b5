"""Greedy MoE generation vs HF's argmax under every cache: Mixtral, Qwen3-MoE and gpt-oss
(its sliding layers' window 8 is shorter than the prompts and continuations)."""
from __future__ import annotations

import pytest

import kvjax
from tests.moe_models import NEW_TOKENS, PROMPTS, hf_greedy, pair_loader


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
  return pair_loader(tmp_path_factory)


@pytest.mark.parametrize("family, caches", [
    ("mixtral", ("paged", "contiguous", "none")), ("qwen3_moe", ("paged", "contiguous", "none")),
    ("gpt_oss", ("paged", "contiguous", "none"))])
def test_greedy_generate_matches_hf(moe_pair, family, caches):
  # Decode: 3 rows x top-2 = 6 <= 8 experts, the switched path; prefill: grouped.
  hf_model, model = moe_pair(family)
  expected = hf_greedy(hf_model, PROMPTS, NEW_TOKENS)
  for cache in caches:
    assert kvjax.generate(model, PROMPTS, NEW_TOKENS, cache=cache, page_size=8).tokens == \
        expected, cache
