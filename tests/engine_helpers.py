"""Shared, cached fixtures of the engine tests: one MTP model, its references.

Every engine test uses the same shapes (4 rows, 16-token chunks, 64-token
model length, 16-token pages, a default or a tiny pool), so the whole engine
suite compiles a handful of steps once.  Prompts are 12..24 tokens and outputs 8, so the `kvjax.generate`
oracle runs in two prefill shapes and one decode loop.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

import kvjax
from kvjax.engine.engine import Engine
from kvjax.model.params import init_params
from kvjax.runtime.sampling import SamplingParams
from kvjax.runtime.step_batch import make_step_batch

MAX_NEW = 8
ENGINE_DEFAULTS = dict(page_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
# 3 usable pages: preemption, and a 58-token request can never fit.
TINY_POOL = 4


@functools.lru_cache(maxsize=None)
def mtp_model() -> kvjax.Model:
  """Random 'tiny' with 2 MTP modules; std 0.2 keeps greedy argmax margins >> rounding."""
  cfg = kvjax.get_preset("tiny").replace(name="tiny-mtp", mtp_num_hidden_layers=2,
                                         eos_token_id=None)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def prompts(n: int, seed: int = 0, shared: int = 0, lengths=(17, 24)) -> list[list[int]]:
  """n prompts of lengths[0]..lengths[1] ids; the first `shared` ids are common to all."""
  rng = np.random.default_rng(seed)
  common = rng.integers(3, 500, shared).tolist()
  lo, hi = max(lengths[0], shared + 1), lengths[1]
  return [common + rng.integers(3, 500, int(rng.integers(lo, hi + 1)) - shared).tolist()
          for _ in range(n)]


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple, max_new: int) -> tuple:
  return tuple(kvjax.generate(mtp_model(), [list(prompt)], max_new).tokens[0])


def reference(prompt, max_new: int = MAX_NEW) -> list[int]:
  """Greedy kvjax.generate of the prompt alone (static batch, the oracle)."""
  return list(_reference(tuple(prompt), max_new))


def engine(**overrides) -> Engine:
  return Engine(mtp_model(), **{**ENGINE_DEFAULTS, **overrides})


def run_staggered_finals(eng: Engine, batch: list[list[int]], max_new: int = MAX_NEW,
                         **sampling) -> list:
  """Add half the prompts, step twice, add the rest, run to the end -> final outputs."""
  half = len(batch) // 2
  ids = [eng.add_request(p, max_new, **sampling) for p in batch[:half]]
  finals = {out.request_id: out for _ in range(2) for out in eng.step() if out.finished}
  ids += [eng.add_request(p, max_new, **sampling) for p in batch[half:]]
  finals.update(run_to_end(eng))
  return [finals[rid] for rid in ids]


def run_staggered(eng: Engine, batch: list[list[int]], max_new: int = MAX_NEW,
                  **sampling) -> dict:
  """run_staggered_finals -> prompt index: output ids."""
  return {i: out.output_ids
          for i, out in enumerate(run_staggered_finals(eng, batch, max_new, **sampling))}


def run_to_end(eng: Engine) -> dict:
  """Step until nothing is left, checking invariants -> request id: final RequestOutput."""
  finals = {}
  for out in eng.stream():
    eng.scheduler.check_invariants()
    if out.finished:
      assert out.request_id not in finals and out.metrics is not None
      assert out.request_id not in eng.metrics  # forgotten once reported
      finals[out.request_id] = out
  assert not eng.metrics
  return finals


def assert_no_pages_held(eng: Engine) -> None:
  eng.scheduler.check_invariants()
  assert eng.scheduler.allocator.num_used == 0


def decode_batch(eng, temperature):
  """Two decode rows (1 + J columns) at positions 5 and 9 of slots 0 and 1."""
  b, t = 2, 1 + eng.num_draft
  tables = np.zeros((b, 8), np.int32)
  tables[0, 0], tables[1, 0] = 1, 2
  sampling = SamplingParams.make(b, temperature=temperature, seeds=[3, 4])
  return make_step_batch(np.full((b, t), 7), [5, 9], [t, t], tables, [0, 1], sampling,
                         num_draft=[eng.num_draft] * b)


def step_static(eng):
  """The static arguments of eng's serve_step."""
  return dict(config=eng.model_config, draft_config=None, backend=eng.config.backend,
              num_draft=eng.num_draft)


def equal_mass_bins(probs: np.ndarray, num_bins: int) -> np.ndarray:
  """Token id -> bin, ids in order of probability, each bin holding about 1 / num_bins of
  the mass (a token heavier than that is a bin alone; the tail joins the last bin)."""
  order = np.argsort(-probs, kind="stable")
  edges = np.cumsum(probs[order])
  bins = np.minimum((edges * num_bins - 1e-9).astype(int), num_bins - 1)
  out = np.empty(len(probs), int)
  out[order] = np.unique(bins, return_inverse=True)[1]  # renumber: no empty bin
  return out


def assert_distribution(samples: np.ndarray, probs: np.ndarray, num_bins: int = 20,
                        p_value: float = 1e-6):
  """Pearson's chi-square of samples against probs over equal-mass bins (about
  n / num_bins expected each, so the test has power where the mass is): fails below
  p_value, the odds of a false failure."""
  from scipy import stats

  bins = equal_mass_bins(probs, num_bins)
  observed = np.bincount(bins[samples], minlength=bins.max() + 1)
  expected = len(samples) * np.bincount(bins, weights=probs, minlength=bins.max() + 1)
  statistic = float(((observed - expected) ** 2 / expected).sum())
  p = stats.chi2.sf(statistic, len(expected) - 1)
  assert p > p_value, (statistic, len(expected) - 1, p)


def sample_first_two(eng: Engine, model: kvjax.Model, prompt: list[int], n: int):
  """Sample n requests of 4 tokens at temperature 1 (seeds 0..n-1) after `prompt`, and
  check their first two tokens against the exact float64 marginals of the target model
  (chi-square over equal-mass bins, assert_distribution).  Returns (finals, first
  [n, 2], p0 [V], p1_given [V, V]), p1_given[a] the distribution after prompt + [a]."""
  vocab = model.config.vocab_size
  ids = [eng.add_request(prompt, 4, temperature=1.0, seed=s) for s in range(n)]
  finals = run_to_end(eng)
  first = np.array([finals[rid].output_ids[:2] for rid in ids])  # [n, 2]
  p0 = np.asarray(jax.nn.softmax(kvjax.forward(model, [prompt])[0, -1]), np.float64)
  extended = np.concatenate([np.tile(prompt, (vocab, 1)), np.arange(vocab)[:, None]], 1)
  p1_given = np.asarray(jax.nn.softmax(kvjax.forward(model, extended)[:, -1]), np.float64)
  p0 /= p0.sum()
  p1_given /= p1_given.sum(axis=1, keepdims=True)
  # P(x1 = b) = sum_a p(a | prompt) p(b | prompt, a).
  for probs, samples in ((p0, first[:, 0]), (p0 @ p1_given, first[:, 1])):
    assert_distribution(samples, probs)
  # And the pairs: (x0, x1) ~ p0(a) p1(b | a), over the likeliest x0 (the rest: one bin).
  pair = (p0[:, None] * p1_given).ravel()
  assert_distribution(first[:, 0] * vocab + first[:, 1], pair)
  return finals, first, p0, p1_given
