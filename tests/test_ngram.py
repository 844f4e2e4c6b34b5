"""Prompt-lookup (n-gram) speculation: drafts equal a brute-force search, greedy output
equals plain decoding, sampled output keeps the target distribution (issue 27)."""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import kvjax
from kvjax.engine.sched.draft_policy import AdaptiveDrafts
from kvjax.engine.sched.ngram import NgramDrafter, NgramIndex
from kvjax.model.params import init_params
from tests import engine_helpers as h


def brute_force_drafts(history, max_n: int, k: int) -> list[int]:
  """The module doc's rule by exhaustive numpy search: for n = max_n..1, every earlier
  window equal to the last n tokens; the latest one's followers, at most k of them and
  none past the history's end."""
  x = np.asarray(history)
  length = len(x)
  for n in range(max_n, 0, -1):
    if n > length - 1:
      continue
    windows = np.lib.stride_tricks.sliding_window_view(x, n)[:length - n]  # end <= L - 2
    hits = np.flatnonzero(np.all(windows == x[length - n:], axis=1))
    if hits.size:
      end = int(hits[-1]) + n - 1
      return x[end + 1:end + 1 + min(k, length - 1 - end)].tolist()
  return []


@pytest.mark.parametrize("max_n,k,alphabet", [(1, 4, 3), (3, 4, 4), (4, 2, 2), (3, 6, 50)])
def test_drafts_equal_the_brute_force_search(max_n, k, alphabet):
  rng = np.random.default_rng(max_n * 100 + alphabet)
  for _ in range(20):
    history = rng.integers(0, alphabet, int(rng.integers(1, 60))).tolist()
    index = NgramIndex(max_n)
    # Grown a few tokens at a time (as decoding grows it), asked at every length.
    for stop in range(1, len(history) + 1):
      assert index.propose(history[:stop], k) == brute_force_drafts(history[:stop], max_n, k)
  long = rng.integers(0, alphabet, 3000).tolist()
  index = NgramIndex(max_n)
  for stop in (7, 300, 301, 2999, 3000):  # big jumps too: a prompt indexed at once
    assert index.propose(long[:stop], k) == brute_force_drafts(long[:stop], max_n, k)


def test_drafts_of_a_known_history():
  # "a b c a b" -> the last 2-gram "a b" occurred at 0..1, followed by "c a b".
  assert NgramIndex(3).propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]
  assert NgramIndex(3).propose([1, 2, 3, 1, 2], 2) == [3, 1]
  assert NgramIndex(3).propose([1, 2, 3, 4], 4) == []  # 4 never occurred before
  assert NgramIndex(3).propose([5], 4) == []
  # The longest n wins over a more recent shorter match: "7 1" (n=2) at 0 beats "1" at 3.
  assert NgramIndex(2).propose([7, 1, 8, 1, 9, 7, 1], 1) == [8]


def test_drafter_keeps_an_index_per_live_request():
  class Req:
    def __init__(self, rid, ids):
      self.request_id, self.token_ids = rid, ids

  drafter = NgramDrafter(2)
  a, b = Req("a", [1, 2, 1]), Req("b", [3, 4, 3])
  assert drafter.propose([a, b], 3, {"a": a, "b": b}) == [[2, 1], [4, 3]]
  assert drafter.propose([a], 0, {"a": a}) == [[]]
  assert set(drafter._index) == {"a"}  # b finished: its index is dropped


@functools.lru_cache(maxsize=None)
def llama() -> kvjax.Model:
  """A random 'tiny' Llama without MTP modules (std 0.2: greedy margins >> rounding)."""
  cfg = kvjax.get_preset("tiny").replace(name="tiny-llama", eos_token_id=None)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(1), std=0.2))


@functools.lru_cache(maxsize=None)
def byte_model() -> kvjax.Model:
  """The built-in trained byte model (it copies repeated text), EOS off: fixed lengths."""
  model = kvjax.load_checkpoint()
  return kvjax.Model(model.config.replace(eos_token_id=None), model.params, model.dtype,
                     model.tokenizer)


@functools.lru_cache(maxsize=None)
def _plain(model_fn, prompt: tuple, max_new: int) -> tuple:
  return tuple(kvjax.generate(model_fn(), [list(prompt)], max_new).tokens[0])


def plain(model_fn, prompt, max_new) -> list[int]:
  """Greedy plain decoding of the prompt alone (kvjax.generate's static batch) by the
  model model_fn() returns."""
  return list(_plain(model_fn, tuple(prompt), max_new))


def repetitive_and_not(seed: int) -> list[list[int]]:
  """Prompts whose tail repeats an earlier stretch (n-gram hits) and random ones."""
  repeated = [p + p[2:10] for p in h.prompts(4, seed=seed, lengths=(12, 16))]
  return repeated + h.prompts(3, seed=seed + 1, shared=12) + h.prompts(2, seed=seed + 2)


@pytest.mark.slow  # over a minute on 2 shared cores (compiles included)
@pytest.mark.parametrize("overrides", [
    dict(prefix_match="block", num_draft=3, num_scheduler_steps=1, num_pages=h.TINY_POOL),
    # The adaptive policy, quick to measure both of its k (0: plain steps, bursts; 4).
    dict(prefix_match="token", num_draft=4, draft_policy=AdaptiveDrafts(4, warmup=1)),
    dict(prefix_cache=False, num_pages=h.TINY_POOL)],
    ids=["block-k3-single-preempting", "token-auto-bursts", "off-k4-preempting"])
def test_ngram_greedy_equals_plain_on_a_random_llama(overrides):
  eng = kvjax.Engine(llama(), **{**h.ENGINE_DEFAULTS, "speculative": "ngram", **overrides})
  batch = repetitive_and_not(seed=40)
  max_new = 24 if "draft_policy" in overrides else h.MAX_NEW  # steps enough to measure
  finals = h.run_staggered_finals(eng, batch, max_new)
  assert [out.output_ids for out in finals] == [plain(llama, p, max_new) for p in batch]
  if "num_pages" in overrides:  # a tiny pool: requests are preempted and recomputed
    assert eng.scheduler.num_preemptions > 0
  assert sum(sum(out.metrics.proposed) for out in finals) > 0
  if "draft_policy" in overrides:
    assert max(eng.steps.num_steps) > 1  # the policy's plain steps ran as bursts
  h.assert_no_pages_held(eng)


BYTE_PROMPTS = ["x = f(x)\nx = f(x)\nx = f(", "for i in a:\n  s += i\nfor j in a:\n  s",
                "self.a = a\nself.b = b\nself.", "def add(a, b):\n  return",
                "import os\nimport sys\n", "class Node:\n  def"]


@pytest.mark.slow  # over a minute on 2 shared cores (compiles included)
@pytest.mark.parametrize("overrides", [dict(num_draft=4, num_scheduler_steps=1),
                                       dict(num_draft="auto", num_pages=5)],
                         ids=["k4-single", "auto-preempting"])
def test_ngram_greedy_equals_plain_on_the_byte_model(overrides):
  model = byte_model()
  batch = [model.tokenizer.encode(s) for s in BYTE_PROMPTS]
  max_new = 24
  eng = kvjax.Engine(model, **{**h.ENGINE_DEFAULTS, "speculative": "ngram", **overrides})
  finals = h.run_staggered_finals(eng, batch, max_new)
  assert [out.output_ids for out in finals] == [plain(byte_model, p, max_new) for p in batch]
  metrics = [out.metrics for out in finals if out.metrics.proposed]
  assert sum(sum(m.accepted) for m in metrics) > 0  # the copies were drafted and accepted
  if "num_pages" in overrides:
    assert eng.scheduler.num_preemptions > 0
  h.assert_no_pages_held(eng)


@pytest.mark.slow  # over a minute on 2 shared cores (compiles included)
def test_sampling_with_ngram_drafts_keeps_the_target_distribution():
  # First two emitted tokens at temperature 1: x0 from the prefill, x1 from the first
  # verify step, whose first draft d(x0) is the n-gram proposal after prompt + x0.
  # Exact from full forwards: P(x1 = b) = sum_a p(a | prompt) p(b | prompt, a), and, since
  # a rejected point-mass draft is never redrawn, P(x1 = d(x0)) = sum_a p(a) p(d(a) | a).
  model = byte_model()
  prompt = model.tokenizer.encode("x = f(x)\nx = f(x)\nx = ")
  n, vocab = 1000, model.config.vocab_size
  eng = kvjax.Engine(model, **{**h.ENGINE_DEFAULTS, "speculative": "ngram", "num_draft": 3,
                               "prefix_cache": False})
  finals, first, p0, p1_given = h.sample_first_two(eng, model, prompt, n)
  draft = [(brute_force_drafts(prompt + [a], 3, 1) or [-1])[0] for a in range(vocab)]
  accept = sum(p0[a] * p1_given[a, d] for a, d in enumerate(draft) if d >= 0)
  assert 0.2 < accept < 0.8  # the prompt exercises acceptance both ways
  hits = sum(int(x1 == draft[x0]) for x0, x1 in first)
  assert abs(hits - n * accept) <= 5 * np.sqrt(n * accept * (1 - accept))


@pytest.mark.parametrize("options,message", [
    (dict(ngram_n=0), "speculative='ngram' needs ngram_n an int >= 1, got 0"),
    (dict(ngram_n="3"), "speculative='ngram' needs ngram_n an int >= 1, got '3'"),
    (dict(num_draft=0), "speculative='ngram' needs num_draft an int >= 1, got 0"),
    (dict(num_draft=-2), "speculative='ngram' needs num_draft an int >= 1, got -2"),
    (dict(speculative="mtp", ngram_n=2), "ngram_n=2 needs speculative='ngram'"),
    (dict(speculative=None, ngram_n=2), "ngram_n=2 needs speculative='ngram'"),
    (dict(kv_dtype="int4"), "kv_dtype 'int4' cannot verify drafts .speculative='ngram'")])
def test_bad_ngram_options_name_the_value(options, message):
  with pytest.raises(ValueError, match=message):
    kvjax.Engine(llama(), **{**h.ENGINE_DEFAULTS, "speculative": "ngram", **options})


def test_ngram_defaults():
  config = kvjax.EngineConfig(speculative="ngram").resolve(llama())
  assert (config.num_draft, config.ngram_n, config.draft_policy) == (4, 3, None)
  auto = kvjax.EngineConfig(speculative="ngram", num_draft="auto").resolve(llama())
  assert (auto.num_draft, auto.draft_policy) == (4, "adaptive")
  assert kvjax.EngineConfig(speculative="mtp").resolve(h.mtp_model()).num_draft == 2
