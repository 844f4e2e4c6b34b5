"""Attention variants in the Pallas ragged paged attention kernel (interpret mode).

The oracle is a float64 numpy softmax per token written here from each rule (the mask
ANDed with causality, the score on the scaled scores), over one ragged batch of decode
rows and prefill chunks on several pages with GQA; the kernel walks it in 2-page steps
and 2 kv splits, so the per-step skip of hidden pages and the split merge both run.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvjax
from kvjax.attention.variants import sinks_window, skipping_range, sliding_window, soft_cap
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference
from tests.test_attention_variants import ALIBI, BOTH, LANDMARK, PROMPT, SLOPES
from tests.test_paged_attention_kernel import SCALE, assert_close, make_problem

F32_TOL = 2e-5
# Decode rows, prefill chunks (one spanning tiles), an empty slot; keys on up to 6 pages.
BATCH = dict(q_lens=[1, 6, 0, 20, 1], kv_lens=[40, 37, 3, 45, 9], kv_heads=2, group=2,
             head_dim=16, page_size=8)  # N = 4 query heads: SLOPES' table
TILING = dict(pages_per_block=2, pages_per_split=4)

# name -> (variant, visible(p, j), score(s, p, j, n)) on numpy float64
RULES = {
    "alibi": (ALIBI, None, lambda s, p, j, n: s - 8.0 * SLOPES[n] * (p - j)),
    "landmark": (LANDMARK, lambda p, j: (p - j < 12) | (j % 8 == 0), None),
    "soft_cap": (soft_cap(30.0), None, lambda s, p, j, n: 30.0 * np.tanh(s / 30.0)),
    "sinks_window": (sinks_window(4, 8), lambda p, j: (j < 4) | (j > p - 8), None),
    # its kv_range narrows each tile's page walk; the mask trims the pages' edges
    "window_kv_range": (sliding_window(10), lambda p, j: j > p - 10, None),
}


def _oracle(pb, visible=None, score=None) -> np.ndarray:
  """float64 [T, N, H]: per token at position p, softmax over the keys j <= p it sees."""
  num_q_heads = pb.q.shape[1]
  kv_heads, _, page_size, _ = pb.k.shape
  group = num_q_heads // kv_heads
  out = np.zeros(pb.q.shape)
  for s, kv_len in enumerate(pb.kv_lens):
    keys = np.arange(kv_len)
    pages = pb.tables[s, keys // page_size]
    ks = pb.k[:, pages, keys % page_size].astype(np.float64)  # [K, S, H]
    vs = pb.v[:, pages, keys % page_size].astype(np.float64)
    if pb.k_scales is not None:  # int8 pages: value * its token's scale
      ks = ks * pb.k_scales[:, pages, keys % page_size, None]
      vs = vs * pb.v_scales[:, pages, keys % page_size, None]
    for i in range(pb.cu[s + 1] - pb.cu[s]):
      t, p = pb.cu[s] + i, kv_len - (pb.cu[s + 1] - pb.cu[s]) + i
      seen = (keys <= p) & (visible(p, keys) if visible else True)
      for n in range(num_q_heads):
        sc = ks[n // group] @ pb.q[t, n].astype(np.float64) * SCALE  # [S]
        sc = (score(sc, p, keys, n) if score else sc)[seen]
        w = np.exp(sc - sc.max())
        out[t, n] = (w / w.sum()) @ vs[n // group][seen]
  return out


@pytest.fixture(scope="module")
def problem():
  pb = make_problem(**BATCH, seed=3)
  pb.q *= 16.0  # scores of tens: the soft cap bends them
  return pb, _oracle(pb)


@pytest.mark.parametrize("name", sorted(RULES))
def test_kernel_and_reference_match_the_float64_rule(problem, name):
  pb, full = problem
  variant, visible, score = RULES[name]
  rules = dict(mask_fn=variant.mask, score_fn=variant.score)
  kernel = ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True, **TILING,
                                  kv_range_fn=skipping_range(variant), **rules)
  want = _oracle(pb, visible, score)
  valid = int(pb.cu[-1])
  assert np.abs(want - full)[:valid].max() > 1e-2, f"{name} does not change the output"
  assert_close(np.asarray(kernel, np.float64)[:valid], want[:valid], F32_TOL, name)
  assert np.all(np.asarray(kernel)[valid:] == 0), "padding tokens must be zero"
  if skipping_range(variant) is None:  # the reference has no kv_range (nothing to skip)
    ref = ragged_paged_attention_reference(*pb.args(), sm_scale=SCALE, **rules)
    assert_close(np.asarray(ref, np.float64)[:valid], want[:valid], F32_TOL, f"ref {name}")


def test_int8_pages_with_a_mask_and_a_slope_table():
  pb = make_problem(**BATCH, int8=True, seed=5)
  pb.q *= 16.0
  _, visible, _ = RULES["landmark"]
  _, _, score = RULES["alibi"]
  got = ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True, **pb.scales(),
                               **TILING, mask_fn=BOTH.mask, score_fn=BOTH.score)
  valid = int(pb.cu[-1])
  want = _oracle(pb, visible, score)[:valid]
  assert_close(np.asarray(got, np.float64)[:valid], want, F32_TOL, "int8 landmark-alibi")


def test_rules_must_be_functions(problem):
  pb, _ = problem
  with pytest.raises(ValueError, match="mask_fn must be a function"):
    ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True, mask_fn=3)


def test_generate_on_pallas_gives_the_reference_greedy(tiny_model):
  prompts = [PROMPT, PROMPT[:29]]  # a prefill chunk and decode rows of two lengths
  want = kvjax.generate(tiny_model, prompts, 6, attention=BOTH).tokens
  full = kvjax.generate(tiny_model, prompts, 6).tokens
  assert want != full, "the variant does not change the greedy"
  for backend in ("pallas_reference", "pallas_interpret"):
    got = kvjax.generate(tiny_model, prompts, 6, backend=backend, attention=BOTH)
    assert got.tokens == want, backend

