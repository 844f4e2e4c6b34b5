"""Batch-invariant decoding: one request's greedy and sampled tokens and their logprobs
are bitwise the same (np.array_equal on float32) alone, beside 1, 7 and 31 other
requests of other lengths, with its prompt chunked at 16 or 64 tokens, after a
prefix-cache hit, and decoded a step per call (pages read each step) instead of in loops
over a gathered copy, with EngineConfig(batch_invariant=True); on the default model and on
a wider float32 random model, where XLA:CPU picks GEMM kernels by row count.

The oracle is the request run alone (no other request, the prompt in one chunk, a cold
cache).  Without the flag the same comparison breaks on at least one path of the wide
model (the one the flag exists for; the default model's narrow dots may be invariant
without it, as on an AVX-512 CPU); the paths already invariant without it are named in
PLAIN_INVARIANT and checked as such.
"""
from __future__ import annotations

import argparse
import functools

import jax
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend, invariant
from kvjax.engine.config import add_engine_flags, engine_config_from_flags
from kvjax.engine.engine import Engine
from kvjax.model.params import init_params
from tests import engine_helpers as h

NEW_TOKENS = 6
TARGET_LEN = 40
# Engine shapes shared by every run of a model: 32 rows for the 31 batch mates.
SHAPES = dict(max_num_seqs=32, max_model_len=128, page_size=16)
# path -> (other requests beside the target, token budget per step, prefix-cache hit,
# decode steps per device call: 1 reads pages each step, 16 loops over a gathered copy)
PATHS = {"beside_1": (1, 64, False, 16), "beside_7": (7, 64, False, 16),
         "beside_31": (31, 64, False, 16), "chunk_16": (0, 16, False, 16),
         "beside_7_chunk_16": (7, 16, False, 16), "prefix_hit": (0, 64, True, 16),
         "single_steps": (0, 64, False, 1)}
ALONE = (0, 64, False, 16)
# Paths whose tokens and logprobs are bitwise the alone run's without the flag: none of
# these on XLA:CPU (docs/GUIDE.md), even beside_1, whose 2-row prefill group takes a
# 128-column chunk bucket for its mate's prompt where the target alone takes 64.
PLAIN_INVARIANT = ()


@functools.lru_cache(maxsize=None)
def _model(name: str) -> kvjax.Model:
  if name == "default":
    return kvjax.load_checkpoint()
  cfg = kvjax.get_preset("tiny").replace(name="tiny-wide", hidden_size=384,
                                         intermediate_size=1024, eos_token_id=None)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def _prompts(vocab: int):
  rng = np.random.default_rng(7)
  target = rng.integers(3, vocab - 1, TARGET_LEN).tolist()
  others = [rng.integers(3, vocab - 1, int(rng.integers(5, 100))).tolist() for _ in range(31)]
  return target, others


@functools.lru_cache(maxsize=None)
def _run(name: str, path: tuple, batch_invariant: bool):
  """The target's (greedy ids, their logprobs, sampled ids, their logprobs) on `path`."""
  num_others, budget, prefix_hit, steps_per_call = path
  model = _model(name)
  target, others = _prompts(model.config.vocab_size)
  eng = Engine(model, max_num_batched_tokens=budget, batch_invariant=batch_invariant,
               num_scheduler_steps=steps_per_call, **SHAPES)
  if prefix_hit:  # another request caches the target's first 2 pages
    eng.add_request(target[:32] + others[0][:5], 2)
    list(eng.stream())
  ids = [eng.add_request(target, NEW_TOKENS, logprobs=1, ignore_eos=True),
         eng.add_request(target, NEW_TOKENS, logprobs=1, ignore_eos=True, temperature=0.9,
                         seed=5)]
  for prompt in others[:num_others]:
    eng.add_request(prompt, NEW_TOKENS)
  got = {rid: ([], []) for rid in ids}
  for out in eng.stream():
    if out.request_id in got:
      got[out.request_id][0].extend(out.new_token_ids)
      got[out.request_id][1].extend(t.logprob for t in out.new_logprobs)
  if prefix_hit:
    assert eng.stats().prefix_hit_tokens >= 32, "no prefix hit"
  return tuple((tuple(tokens), np.asarray(logprobs, np.float32))
               for tokens, logprobs in got.values())


def _same(a, b) -> bool:
  return all(x[0] == y[0] and np.array_equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", ["default", "wide"])
def test_batch_invariant_tokens_and_logprobs_are_bitwise_equal(name, path):
  alone = _run(name, ALONE, True)
  got = _run(name, PATHS[path], True)
  assert all(len(tokens) == NEW_TOKENS for tokens, _ in got)
  assert _same(got, alone), f"{path}: {got} != alone {alone}"


@pytest.mark.parametrize("name", ["default", "wide"])
def test_without_the_flag_some_path_breaks_and_the_named_ones_hold(name):
  alone = _run(name, ALONE, False)
  same = {path for path, shape in PATHS.items() if _same(_run(name, shape, False), alone)}
  assert same >= set(PLAIN_INVARIANT), f"plain invariant paths: {sorted(same)}"
  # The wide model's dots make XLA:CPU choose GEMM kernels by row count on every CPU seen;
  # the default model's narrow ones stayed invariant on an AVX-512 EPYC without the flag.
  if name == "wide":
    assert same != set(PATHS), "every path is invariant without the flag: it needs no flag"


def test_what_batch_invariant_cannot_cover_is_refused_by_name():
  model = h.mtp_model()
  with pytest.raises(ValueError, match="batch_invariant needs speculative=None"):
    kvjax.EngineConfig(batch_invariant=True, speculative="mtp").resolve(model)
  with pytest.raises(ValueError, match="batch_invariant needs backend 'reference'"):
    kvjax.EngineConfig(batch_invariant=True, backend="pallas_reference").resolve(model)
  with pytest.raises(ValueError, match="batch_invariant must be True or False"):
    kvjax.EngineConfig(batch_invariant=1).resolve(model)
  resolved = kvjax.EngineConfig(batch_invariant=True).resolve(model)
  assert resolved.backend.batch_invariant
  reference = invariant(get_backend("reference"))
  assert resolved.backend.gathered_attention is reference.gathered_attention  # blocked loops
  parser = argparse.ArgumentParser()
  add_engine_flags(parser)
  assert engine_config_from_flags(parser.parse_args(["--batch-invariant"])).batch_invariant
  assert not engine_config_from_flags(parser.parse_args([])).batch_invariant


def test_batch_invariant_logprobs_equal_the_cache_free_forward():
  """The oracle for the runs above: the greedy request's logprobs are those of a float64
  log-softmax of kvjax.forward's logits (float32 noise), and its ids their argmaxes."""
  model = _model("default")
  target, _ = _prompts(model.config.vocab_size)
  (tokens, logprobs), _ = _run("default", ALONE, True)
  logits = np.asarray(kvjax.forward(model, [target + list(tokens)]), np.float64)[0]
  rows = logits[len(target) - 1:len(target) + len(tokens) - 1]
  rows = rows - rows.max(-1, keepdims=True)
  expected = rows - np.log(np.exp(rows).sum(-1, keepdims=True))
  np.testing.assert_array_equal(np.argmax(expected, -1), tokens)
  np.testing.assert_allclose(logprobs, expected[np.arange(len(tokens)), tokens], atol=1e-5)
