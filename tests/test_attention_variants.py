"""Attention variants (kvjax/attention/variants.py): one rule, every path.

The oracle is a dense float64 numpy forward of the default model written here from
each rule (the mask ANDed with causality, the score on the scaled scores); kvjax's
forward must match it within float32 noise, and every cache path's greedy tokens
must equal the no-cache greedy under the same variant.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.attention import variants
from kvjax.attention.mla import mla_paged_attention
from kvjax.attention.paged import paged_attention
from kvjax.attention.variants import sinks_window, sliding_window, soft_cap
from kvjax.caches import PagedKVCache
from kvjax.runtime.step_batch import make_step_batch
from tests import engine_helpers
from tests.test_blocked_attention import _brute_force, pages  # noqa: F401 (a fixture)


def _alibi_slopes(n: int) -> np.ndarray:
  return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)


SLOPES = _alibi_slopes(4)  # the default model's 4 query heads

# name -> (variant, numpy rule: (visible [T, S] bool, scores [N, T, S]) -> (visible, scores))
ALIBI = kvjax.AttentionVariant(
    "alibi", score=lambda s, q, k, h: s - 8.0 * jnp.asarray(SLOPES, jnp.float32)[h] * (q - k))
LANDMARK = kvjax.AttentionVariant("landmark", mask=lambda q, k: (q - k < 12) | (k % 8 == 0))
DILATED = kvjax.AttentionVariant("dilated", mask=lambda q, k: (q - k < 24) & ((q - k) % 3 == 0))


def _positions(t):
  q, k = np.arange(t)[:, None], np.arange(t)[None, :]
  return q, k


RULES = {
    "alibi": (ALIBI, lambda vis, s, q, k: (vis, s - 8.0 * SLOPES[:, None, None] * (q - k))),
    "landmark": (LANDMARK, lambda vis, s, q, k: (vis & ((q - k < 12) | (k % 8 == 0)), s)),
    "dilated": (DILATED, lambda vis, s, q, k: (vis & (q - k < 24) & ((q - k) % 3 == 0), s)),
    "sinks_window": (sinks_window(4, 8),
                     lambda vis, s, q, k: (vis & ((k < 4) | (k > q - 8)), s)),
    "soft_cap": (soft_cap(0.5), lambda vis, s, q, k: (vis, 0.5 * np.tanh(s / 0.5))),
}

PROMPT = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")


@pytest.fixture(scope="module")
def model():
  return kvjax.load_checkpoint()


def _oracle_logits(model, tokens, rule_of_layer) -> np.ndarray:
  """float64 logits [T, V] of one sequence; rule_of_layer(layer) -> numpy rule or None."""
  cfg, p = model.config, model.params
  f64 = lambda x: np.asarray(x, np.float64)
  norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * f64(w)
  t = len(tokens)
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
  angles = np.arange(t)[:, None] * inv_freq  # [T, H/2]
  cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

  def rope(x):  # [T, heads, H], rotate-half
    x1, x2 = np.split(x, 2, -1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  x = f64(p.embed)[tokens]
  q_pos, k_pos = _positions(t)
  group = cfg.num_heads // cfg.num_kv_heads
  for layer, b in enumerate(p.blocks):
    h = norm(x, b.attn_norm)
    q = rope(np.einsum("td,dnh->tnh", h, f64(b.attn.wq)))
    k = np.repeat(rope(np.einsum("td,dkh->tkh", h, f64(b.attn.wk))), group, axis=1)
    v = np.repeat(np.einsum("td,dkh->tkh", h, f64(b.attn.wv)), group, axis=1)
    s = np.einsum("tnh,snh->nts", q, k) * cfg.head_dim ** -0.5
    visible = k_pos <= q_pos
    rule = rule_of_layer(layer)
    if rule is not None:
      visible, s = rule(visible, s, q_pos, k_pos)
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("nts,snh->tnh", w / w.sum(-1, keepdims=True), v)
    x = x + np.einsum("tnh,nhd->td", out, f64(b.attn.wo))
    h = norm(x, b.mlp_norm)
    gate = h @ f64(b.w_gate)
    x = x + (gate / (1 + np.exp(-gate)) * (h @ f64(b.w_up))) @ f64(b.w_down)
  return norm(x, p.final_norm) @ f64(p.head())


@pytest.mark.parametrize("name", sorted(RULES))
def test_forward_matches_the_float64_oracle_and_changes_the_greedy(model, name):
  variant, rule = RULES[name]
  tokens = np.array(PROMPT, np.int32)
  got = np.asarray(kvjax.forward(model, tokens[None], attention=variant))[0]
  want = _oracle_logits(model, tokens, lambda layer: rule)
  np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
  full = _oracle_logits(model, tokens, lambda layer: None)
  assert (want.argmax(-1) != full.argmax(-1)).any(), f"{name} never changes a greedy token"


def test_per_layer_variant_matches_the_oracle(model):
  tokens = np.array(PROMPT, np.int32)
  attention = lambda cfg, layer: LANDMARK if layer % 2 else None
  got = np.asarray(kvjax.forward(model, tokens[None], attention=attention))[0]
  landmark = RULES["landmark"][1]
  want = _oracle_logits(model, tokens, lambda layer: landmark if layer % 2 else None)
  np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("t", [12, 2], ids=["blocked prefill", "decode gather"])
def test_window_variant_with_kv_range_starts_the_block_walk_late_and_matches(pages, t):
  q, k, v, _, tables = pages
  kv_lens = np.array([310, 300, 280], np.int32)  # every row's window past block 2's start
  got = paged_attention(jnp.asarray(q[:, :t]), jnp.asarray(k), jnp.asarray(v),
                        jnp.asarray(kv_lens), jnp.asarray(tables), sm_scale=0.3, layer=1,
                        variant=sliding_window(8))
  want = _brute_force(q[:, :t], k[1], v[1], kv_lens, tables, 0.3, window=8)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


# Both functions at once: the landmark mask and the ALiBi score.
BOTH = kvjax.register_variant(
    kvjax.AttentionVariant("landmark-alibi", mask=LANDMARK.mask, score=ALIBI.score))


def _no_cache_greedy(model, prompts, n):
  return kvjax.generate(model, prompts, n, cache="none", attention=BOTH).tokens


def test_every_cache_path_gives_the_no_cache_greedy(model):
  prompts = [PROMPT, PROMPT[:29]]
  want = _no_cache_greedy(model, prompts, 12)
  for cache in ("paged", "contiguous"):  # paged: the blocked prefill, the gathered decode loop
    assert kvjax.generate(model, prompts, 12, cache=cache, attention=BOTH).tokens == want, cache


def test_engine_prefix_hits_and_ngram_drafts_apply_the_variant(model):
  prompts = [PROMPT + list(b"(n - 1)"), PROMPT + list(b"(n - 2)")]  # a shared prefix
  want = _no_cache_greedy(model, prompts, 12)
  engine = kvjax.Engine(model, kvjax.EngineConfig(attention="landmark-alibi"),
                        speculative="ngram", page_size=8, max_num_seqs=2, max_model_len=128)
  got = [engine.generate([p], 12).tokens[0] for p in prompts]  # the second one hits
  assert engine.stats().prefix_hit_tokens >= len(PROMPT) - 8
  assert max(engine.steps.num_draft) > 0  # steps verified n-gram drafts
  assert got == want


def test_a_backend_that_cannot_apply_a_variant_is_refused(model):
  with pytest.raises(ValueError, match="attention variants.*landmark"):
    kvjax.generate(model, [PROMPT], 2, kv_dtype="streaming", attention=LANDMARK)
  with pytest.raises(ValueError, match="unknown attention variant 'nope'"):
    kvjax.forward(model, np.array([PROMPT]), attention="nope")


def _paged_steps(variant, dtype, steps=(21, 9, 1)):
  """One row through a PagedKVCache of `dtype` pages (Z = 4, shuffled physical pages), the
  chunks `steps` each attending what the earlier ones stored -> (q, k, v, out) float64."""
  num_kv, n, h, t_all = 2, 4, 16, sum(steps)
  cache = PagedKVCache.create(1, num_kv, 12, 4, h, dtype)
  tables = np.array([[3, 7, 1, 9, 4, 11, 2, 8]], np.int32)
  rng = np.random.default_rng(1)
  q_all, k_all, v_all = (rng.normal(size=(t_all, heads, h)) for heads in (n, num_kv, num_kv))
  out, start = [], 0
  for t in steps:
    batch = make_step_batch(np.zeros((1, t)), [start], [t], tables, [0])
    cache, o = cache.attend(0, *(jnp.asarray(x[None, start:start + t], jnp.float32)
                                 for x in (q_all, k_all, v_all)),
                            batch, sm_scale=h ** -0.5,
                            backend=get_backend("reference"), variant=variant)
    out.append(np.asarray(o[0], np.float64))
    start += t
  return q_all, k_all, v_all, np.concatenate(out)


def _dense_float64(q, k, v, rules):
  """The float64 attention of every position of q [T, N, H] over k, v [T, K, H] under
  `rules` (RULES' numpy rules applied in turn) -> [T, N, H]."""
  t, n, h = q.shape
  group = n // k.shape[1]
  q_pos, k_pos = _positions(t)
  s = np.einsum("tnh,snh->nts", q, np.repeat(k, group, axis=1)) * h ** -0.5
  visible = k_pos <= q_pos
  for rule in rules:
    visible, s = rule(visible, s, q_pos, k_pos)
  s = np.where(visible, s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("nts,snh->tnh", w / w.sum(-1, keepdims=True), np.repeat(v, group, axis=1))


def test_int8_pages_with_a_variant_agree_as_closely_as_without_one():
  """int8 pages' error against the float64 attention, with the landmark mask + ALiBi score
  and without a variant: of the same size (and float32 pages exact)."""
  rules = (RULES["landmark"][1], RULES["alibi"][1])
  err = {}
  for name, variant, rule in (("full", None, ()), ("variant", BOTH, rules)):
    for dtype in (jnp.float32, jnp.int8):
      q, k, v, out = _paged_steps(variant, dtype)
      err[name, dtype] = np.abs(out - _dense_float64(q, k, v, rule)).max()
  changed = np.abs(_dense_float64(q, k, v, rules) - _dense_float64(q, k, v, ())).max()
  assert err["full", jnp.float32] < 1e-5 and err["variant", jnp.float32] < 1e-5
  assert 1e-3 < err["full", jnp.int8] < 0.1 * changed  # int8 is lossy, the variant matters
  assert err["variant", jnp.int8] <= 1.5 * err["full", jnp.int8], err


def _pages_float64(q, keys, values, kv_lens, tables, rules):
  """float64 paged attention of q [B, T, N, H] (padded rows) over keys [K, P, Z, H] and
  values [K, P, Z, Hv] through tables, RULES' numpy rules applied in turn on the scaled
  scores -> [B, T, N, Hv]."""
  b, t, n, _ = q.shape
  group = n // keys.shape[0]
  z = keys.shape[2]
  out = np.zeros((b, t, n, values.shape[-1]))
  for row in range(b):
    s_len = kv_lens[row]
    j = np.arange(s_len)
    k_row, v_row = (np.repeat(x[:, tables[row, j // z], j % z], group, axis=0).astype(np.float64)
                    for x in (keys, values))  # [N, S, H]
    q_pos, k_pos = (s_len - t + np.arange(t))[:, None], j[None, :]
    s = np.einsum("tnh,nsh->nts", q[row].astype(np.float64), k_row) * 0.3
    visible = k_pos <= q_pos
    for rule in rules:
      visible, s = rule(visible, s, q_pos, k_pos)
    s = np.where(visible, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out[row] = np.einsum("nts,nsh->tnh", w / w.sum(-1, keepdims=True), v_row)
  return out


_CAP = lambda vis, s, q, k: (vis, 2.0 * np.tanh(s / 2.0))
_WINDOW = lambda w: lambda vis, s, q, k: (vis & (k > q - w), s)
# name -> (both(first, second), the two numpy rules in the same order)
COMBINED = {
    # the sinks' leading keys survive a second mask without a kv_range: the walk must read
    # block 0 then jump to the window's blocks
    "sinks+landmark": (variants.both(sinks_window(4, 24), LANDMARK),
                       (lambda vis, s, q, k: (vis & ((k < 4) | (k > q - 24)), s),
                        RULES["landmark"][1])),
    "window+landmark-alibi": (variants.both(sliding_window(30), BOTH),
                              (_WINDOW(30), RULES["landmark"][1], RULES["alibi"][1])),
    "softcap then alibi": (variants.both(soft_cap(2.0), ALIBI), (_CAP, RULES["alibi"][1])),
    "window24+sinks2-window40": (variants.both(sliding_window(24), sinks_window(2, 40)),
                                 (_WINDOW(24), lambda vis, s, q, k: (
                                     vis & ((k < 2) | (k > q - 40)), s))),
}


@pytest.mark.parametrize("t", [12, 2], ids=["blocked prefill", "decode gather"])
@pytest.mark.parametrize("name", sorted(COMBINED))
def test_two_variants_at_once_match_the_float64_oracle(pages, name, t):
  variant, rules = COMBINED[name]
  q, k, v, _, tables = pages
  kv_lens = np.array([310, 300, 280], np.int32)  # every row's window past block 2's start
  got = paged_attention(jnp.asarray(q[:, :t]), jnp.asarray(k), jnp.asarray(v),
                        jnp.asarray(kv_lens), jnp.asarray(tables), sm_scale=0.3, layer=1,
                        variant=variant)
  want = _pages_float64(q[:, :t], k[1], v[1], kv_lens, tables, rules)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  alone = _pages_float64(q[:, :t], k[1], v[1], kv_lens, tables, rules[1:])
  assert np.abs(want - alone).max() > 1e-2, f"{name}: the first variant changes nothing"
  reversed_rules = _pages_float64(q[:, :t], k[1], v[1], kv_lens, tables, rules[::-1])
  if name == "softcap then alibi":  # the order of the scores matters, and is kept
    assert np.abs(want - reversed_rules).max() > 1e-2


def test_both_record():
  window, sinks = sliding_window(8), sinks_window(4, 16)
  assert variants.both(window, None) is window and variants.both(None, None) is None
  assert variants.both(window, sinks) is variants.both(window, sinks)  # one compilation
  combined = variants.both(window, sinks)
  assert combined.monotone and combined.leading_keys == 4
  assert [int(x) for x in combined.kv_range(jnp.asarray(100))] == [93, 101]
  assert variants.both(window, soft_cap(3.0)).monotone  # a score hides nothing
  assert not variants.both(window, kvjax.AttentionVariant("m", mask=LANDMARK.mask)).monotone


@pytest.mark.parametrize("t", [12, 2], ids=["blocked prefill", "decode gather"])
@pytest.mark.parametrize("name", ["alibi", "landmark", "sinks_window"])
def test_mla_latent_pages_apply_the_variant(pages, name, t):
  """MLA's latent attention (one kv head whose keys are the whole row [R + Hr], values its
  first R dims; query head n is score head n) under each rule against the float64 oracle."""
  *_, tables = pages
  kv_lens = np.array([310, 300, 280], np.int32)
  rng = np.random.default_rng(2)
  r, hr = 12, 4
  latent = rng.normal(size=(2, 48, 8, r + hr)).astype(np.float32)  # [L, P, Z, R + Hr]
  q = rng.normal(size=(3, t, 4, r + hr)).astype(np.float32)  # [B, T, N, R + Hr]
  variant, rule = RULES[name]
  got = mla_paged_attention(jnp.asarray(q), jnp.asarray(latent), jnp.asarray(kv_lens),
                            jnp.asarray(tables), value_dim=r, sm_scale=0.3, layer=1,
                            variant=variant)
  entries = latent[1][None]  # [1, P, Z, R + Hr]
  want = _pages_float64(q, entries, entries[..., :r], kv_lens, tables, (rule,))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  full = _pages_float64(q, entries, entries[..., :r], kv_lens, tables, ())
  assert np.abs(want - full).max() > 1e-2, f"{name} changes nothing"



@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_engine_under_preemption_and_mtp_drafts_applies_the_variant(speculative):
  """A pool too small for three requests at once (preempted, resumed) and MTP drafts
  verified under landmark + ALiBi give the no-cache greedy, which the variant changes."""
  model = engine_helpers.mtp_model()  # 'tiny': 4 query heads, as SLOPES
  prompts = engine_helpers.prompts(3, seed=4, lengths=(40, 48))
  want = _no_cache_greedy(model, prompts, 24)
  assert want != kvjax.generate(model, prompts, 24, cache="none").tokens
  engine = kvjax.Engine(model, attention=BOTH, speculative=speculative, page_size=8,
                        max_num_seqs=3, num_pages=14, max_model_len=96)
  assert engine.generate(prompts, 24).tokens == want
  assert engine.scheduler.num_preemptions > 0
  if speculative:
    assert max(engine.steps.num_draft) > 0
