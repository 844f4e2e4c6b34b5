"""generate(): batch independence, compile counts, bad input, sampling statistics."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.runtime import generation
from kvjax.runtime import steps
from kvjax.runtime import sampling
from kvjax.runtime.sampling import SamplingParams, filtered_logits, greedy_tokens, sample

PROMPTS = [[5, 9, 11], [7] * 13, [100, 3, 200, 4, 300, 5, 400, 6, 1]]


@pytest.mark.parametrize("cache", ["paged", "contiguous", "none"])
def test_mixed_batch_equals_each_prompt_alone(tiny_model, cache):
  together = kvjax.generate(tiny_model, PROMPTS, 12, cache=cache).tokens
  alone = [kvjax.generate(tiny_model, [p], 12, cache=cache).tokens[0] for p in PROMPTS]
  assert together == alone
  assert all(len(t) == 12 for t in together)


def test_sampled_batch_equals_each_prompt_alone(tiny_model):
  kwargs = dict(temperature=0.8, top_k=50, top_p=0.95, seed=[11, 12, 13])
  together = kvjax.generate(tiny_model, PROMPTS, 10, **kwargs).tokens
  for i, p in enumerate(PROMPTS):
    alone = kvjax.generate(tiny_model, [p], 10, temperature=0.8, top_k=50, top_p=0.95,
                           seed=11 + i).tokens[0]
    assert together[i] == alone
  again = kvjax.generate(tiny_model, PROMPTS, 10, **kwargs).tokens
  assert again == together  # seeded: reproducible
  other = kvjax.generate(tiny_model, PROMPTS, 10, **{**kwargs, "seed": [1, 2, 3]}).tokens
  assert other != together


def test_generation_compiles_a_bounded_number_of_times(tiny_model, monkeypatch):
  # A fresh (equal-shaped, differently named) config, so no earlier test's compile counts.
  model = kvjax.Model(tiny_model.config.replace(name="trace-count"), tiny_model.params)
  # One prefill and one decode loop trace the model step; nothing else may.
  counted = chex.assert_max_traces(steps.model_step, n=2)
  monkeypatch.setattr(steps, "model_step", counted)
  monkeypatch.setattr(generation, "model_step", counted)
  before = (steps.prefill._cache_size(), generation._decode_loop._cache_size())
  # Rows bucket 1, prompt bucket 8, total bucket 16, decode-steps bucket 8 throughout.
  for prompt in ([4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]):
    for new in (6, 8, 9):
      assert len(kvjax.generate(model, [prompt], new).tokens[0]) == new
  after = (steps.prefill._cache_size(), generation._decode_loop._cache_size())
  assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_eos_stops_generation(tiny_model):
  cfg = tiny_model.config
  free = kvjax.generate(tiny_model, [PROMPTS[0]], 12).tokens[0]
  eos = free[4]
  model = kvjax.Model(cfg.replace(eos_token_id=eos), tiny_model.params)
  for cache in ("paged", "none"):
    stopped = kvjax.generate(model, [PROMPTS[0]], 12, cache=cache).tokens[0]
    assert stopped == free[:free.index(eos) + 1]


BAD_INPUTS = {
    "empty prompt": (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    "no prompts": (dict(prompts=[]), "prompts is empty"),
    "id >= vocab": (dict(prompts=[[1, 512]]), "token id 512"),
    "negative id": (dict(prompts=[[-3, 1]]), "token id -3"),
    "too long": (dict(prompts=[[1] * 1000], max_new_tokens=100), "exceeds the model context 1024"),
    "zero new tokens": (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    "unknown cache": (dict(cache="ring"), "unknown cache 'ring'"),
    "bad top_p": (dict(top_p=1.5), "top_p must be in"),
    "bad temperature": (dict(temperature=-1.0), r"temperature must be in \[0, "),
    "unknown backend": (dict(backend="cuda-magic"), "unknown attention backend 'cuda-magic'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_the_value_and_changes_nothing(tiny_model, case):
  overrides, message = BAD_INPUTS[case]
  args = dict(prompts=[[1, 2, 3]], max_new_tokens=4)
  args.update(overrides)
  before = jax.tree_util.tree_map(np.asarray, tiny_model.params)
  reference = kvjax.generate(tiny_model, [[1, 2, 3]], 4).tokens
  with pytest.raises(ValueError, match=message):
    kvjax.generate(tiny_model, args.pop("prompts"), args.pop("max_new_tokens"), **args)
  after = jax.tree_util.tree_map(np.asarray, tiny_model.params)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                   jax.tree_util.tree_leaves(after)))
  assert kvjax.generate(tiny_model, [[1, 2, 3]], 4).tokens == reference


def test_load_checkpoint_errors_name_the_value():
  with pytest.raises(ValueError, match="'not-a-model'"):
    kvjax.load_checkpoint("not-a-model")
  with pytest.raises(ValueError, match="unsupported dtype 'int3'"):
    kvjax.load_checkpoint("tiny", dtype="int3")


def test_forward_rejects_bad_tokens(tiny_model):
  with pytest.raises(ValueError, match="token id 9999"):
    kvjax.forward(tiny_model, np.array([[1, 9999]]))
  with pytest.raises(ValueError, match=r"shape \(3,\)"):
    kvjax.forward(tiny_model, np.array([1, 2, 3]))


def _brute_force_filter(logits, k, p):
  """Keep the k largest, then the smallest prefix with mass >= p (numpy, float64)."""
  order = np.argsort(-logits, kind="stable")
  keep = np.zeros(logits.size, bool)
  kept = order[:k] if k > 0 else order
  probs = np.exp(logits[kept] - logits[kept].max())
  probs /= probs.sum()
  mass = 0.0
  for idx, prob in zip(kept, probs):
    keep[idx] = True
    mass += prob
    if mass >= p:
      break
  return keep


@pytest.mark.parametrize("k,p", [(0, 1.0), (5, 1.0), (0, 0.5), (10, 0.8), (1, 0.3)])
def test_top_k_top_p_filter_matches_brute_force(k, p):
  rng = np.random.default_rng(k * 100 + int(p * 10))
  logits = rng.normal(size=(4, 64)).astype(np.float32) * 2
  got = np.asarray(filtered_logits(jnp.asarray(logits), jnp.full((4,), k, jnp.int32),
                                   jnp.full((4,), p, jnp.float32)))
  for row in range(4):
    np.testing.assert_array_equal(np.isfinite(got[row]), _brute_force_filter(logits[row], k, p))


def _candidate_rows(vocab):
  """Rows whose top-k set and nucleus lie among their 8 largest logits (a peaked row) and
  rows reaching past them (a flat row with top_p 0.99, top_k 20 > 8, a row with every
  token), with their (top_k, top_p)."""
  rng = np.random.default_rng(7)
  peaked = rng.normal(size=vocab) * 0.5
  peaked[rng.choice(vocab, 3, replace=False)] += 12  # three tokens hold ~all the mass
  flat = rng.normal(size=vocab) * 0.1
  rows = [(peaked, 0, 0.9), (flat, 5, 1.0), (peaked, 3, 0.5), (flat, 0, 1.0),
          (flat, 0, 0.99), (peaked, 20, 0.95), (flat, 20, 1.0)]
  logits, k, p = zip(*rows)
  return np.stack(logits).astype(np.float32), np.array(k, np.int32), np.array(p, np.float32)


def test_the_largest_candidates_decide_only_the_rows_they_can():
  """A row is settled by its 8 largest logits when its top-k set (k <= 8), or with top-k
  off its nucleus (or every token: top_p 1), ends among them; not when top_k > 8 or the
  nucleus reaches past them."""
  logits, k, p = _candidate_rows(64)
  largest, _ = jax.lax.top_k(jnp.asarray(logits), 8)
  top_k = jnp.asarray(np.where(k > 0, k, 64))  # kept_threshold's k: the vocabulary when off
  _, settled = sampling.kept_threshold(largest, top_k, jnp.asarray(p), jnp.asarray(logits))
  assert np.asarray(settled).tolist() == [True, True, True, True, False, False, False]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 1, 2, 3, 4], list(range(7))])
def test_top_k_top_p_from_the_largest_candidates_match_brute_force(rows):
  """Batches every row of which the 8 largest candidates settle, and batches with rows
  they do not (the whole batch then sorts): the kept sets equal the float64 oracle's."""
  logits, k, p = (a[rows] for a in _candidate_rows(64))
  got = np.asarray(sampling.filtered_logits(jnp.asarray(logits), jnp.asarray(k),
                                            jnp.asarray(p), candidates=8))
  for row in range(len(rows)):
    want = _brute_force_filter(logits[row], int(k[row]), float(p[row]))
    np.testing.assert_array_equal(np.isfinite(got[row]), want)
    np.testing.assert_array_equal(got[row][want], logits[row][want])


def test_bisection_finds_the_sorted_thresholds():
  """bisected_threshold against the float64 oracle on rows a sort-free search could trip
  on: ties (integer logits), -inf entries (a grammar's mask) with top_k past the finite
  ones, one dominant token, top_k over the vocabulary, top_p 1 and a tiny top_p."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(6, 300)).astype(np.float32) * 2
  logits[1, 50:] = -np.inf
  logits[2] = np.round(logits[2])
  logits[3, :5] += 15
  top_k = np.array([0, 80, 7, 0, 400, 299], np.int32)
  top_p = np.array([0.9, 0.99, 0.5, 0.95, 1.0, 1e-30], np.float32)
  k = jnp.asarray(np.where(top_k > 0, np.minimum(top_k, 300), 300))
  threshold = np.asarray(sampling.bisected_threshold(jnp.asarray(logits), k,
                                                     jnp.asarray(top_p)))
  for row in range(6):
    want = _brute_force_filter(logits[row], int(top_k[row]), float(top_p[row]))
    finite = np.isfinite(logits[row])
    np.testing.assert_array_equal((logits[row] >= threshold[row]) & finite, want & finite)


def test_no_top_k_and_top_p_one_leave_the_logits_unchanged():
  """A row without top-k / top-p comes out bit for bit (prefill programs always filter,
  kvjax/runtime/serve_steps.py program_variant), tails that float32's cumulative mass rounds to 1
  before they start included: one dominant logit over 63 at -30 (p ~ 1e-13 each), and
  -inf entries (a grammar's mask) left -inf."""
  logits = np.full((3, 64), -30.0, np.float32)
  logits[:, 0] = 0.0
  logits[1, 40:] = -np.inf
  logits[2] = np.random.default_rng(0).normal(size=64) * 4
  got = np.asarray(filtered_logits(jnp.asarray(logits), jnp.zeros(3, jnp.int32),
                                   jnp.ones(3, jnp.float32)))
  np.testing.assert_array_equal(got, logits)


# top_p over the float32 range: the float64 smallest denormal (0 in float32), float32's
# smallest denormal, issue 33's 1e-39 (a denormal XLA flushes to 0), the smallest normal,
# then ordinary values (1.0 is in the test above: near 1 the oracle's float64 mass and
# the filter's float32 one round the tail differently).
TINY_TO_ONE = [5e-324, float(np.nextafter(np.float32(0), np.float32(1))), 1e-39,
               float(np.finfo(np.float32).tiny), 1e-30, 1e-10, 1e-3, 0.1, 0.5, 0.9]


@pytest.mark.parametrize("candidates", [64, 8, 1], ids=["sorted", "candidates", "bisection"])
@pytest.mark.parametrize("p", TINY_TO_ONE)
def test_top_p_keeps_the_top_token_over_the_float32_range(p, candidates):
  """Each way the filter finds a row's threshold: sorting a vocabulary no larger than the
  candidates, from the 8 largest logits, and by bisection (a single candidate settles
  a row only when its nucleus is the top token)."""
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(4, 64)).astype(np.float32) * 3
  for k in (0, 5):
    got = np.asarray(filtered_logits(jnp.asarray(logits), jnp.full((4,), k, jnp.int32),
                                     jnp.full((4,), p, jnp.float32), candidates=candidates))
    for row in range(4):
      want = _brute_force_filter(logits[row], k, float(np.float32(p)))
      np.testing.assert_array_equal(np.isfinite(got[row]), want)


@pytest.mark.parametrize("p", [5e-324, 1e-39, 1e-37])
def test_a_tiny_top_p_samples_the_greedy_tokens(tiny_model, p):
  # A nucleus of one: whatever the seed, the draw is the argmax (issue 33: 1e-39 drew id 0).
  greedy = kvjax.generate(tiny_model, PROMPTS, 6).tokens
  assert kvjax.generate(tiny_model, PROMPTS, 6, temperature=1.0, top_p=p,
                        seed=[1, 2, 3]).tokens == greedy
  engine = kvjax.Engine(tiny_model, max_num_seqs=4, max_model_len=64, page_size=16)
  assert engine.generate(PROMPTS, 6, temperature=1.0, top_p=p, seed=[1, 2, 3]).tokens == greedy


def test_greedy_tokens_pick_the_first_largest_logit():
  """Oracle: numpy's argmax (first maximum) after NaN -> -inf; ties, infinities, NaN rows."""
  rng = np.random.default_rng(7)
  logits = rng.integers(-3, 4, size=(64, 37)).astype(np.float32)  # many ties
  logits[1, 5] = np.inf
  logits[2, 3], logits[2, 30] = np.nan, np.inf
  logits[3] = -np.inf
  logits[4] = np.nan
  logits[5, :4] = np.nan
  expected = np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=-1)
  np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(logits))), expected)
  batched = np.asarray(greedy_tokens(jnp.asarray(logits.reshape(8, 8, 37))))
  np.testing.assert_array_equal(batched, expected.reshape(8, 8))


def test_temperature_sampling_follows_softmax():
  logits = jnp.asarray([2.0, 1.0, 0.0, -1.0, -30.0, 0.5], jnp.float32)
  n, temperature = 40_000, 0.7
  params = SamplingParams.make(n, temperature=temperature, seeds=jnp.arange(n))
  drawn = np.asarray(sample(jnp.broadcast_to(logits, (n, 6)), params, jnp.zeros(n, jnp.int32),
                            use_filter=False))
  probs = np.asarray(jax.nn.softmax(logits / temperature))
  counts = np.bincount(drawn, minlength=6)
  bound = 6 * np.sqrt(n * probs * (1 - probs)) + 5
  assert np.all(np.abs(counts - n * probs) <= bound), (counts, n * probs)
  greedy = sample(jnp.broadcast_to(logits, (3, 6)), SamplingParams.make(3), jnp.zeros(3, jnp.int32),
                  use_filter=False)
  assert np.asarray(greedy).tolist() == [0, 0, 0]
