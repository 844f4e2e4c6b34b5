"""vLLM's request extensions: penalties, logit_bias, min_tokens, ignore_eos, stop_token_ids.

Oracle: a float64 numpy greedy decoder over the full causal forward (kvjax.forward,
no cache, no engine) that applies vLLM's apply_penalties semantics itself, written
here from vLLM's definitions, not from kvjax/runtime/logit_processors.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.engine.engine import Engine
from kvjax.model.params import init_params
from kvjax.runtime.logit_processors import LogitProcessing

MAX_NEW = 8
ENGINE = dict(page_size=16, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


@functools.lru_cache(maxsize=None)
def _model(eos=None) -> kvjax.Model:
  cfg = kvjax.get_preset("tiny").replace(name="tiny-vllm", eos_token_id=eos)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(3), std=0.2))


def _prompts():
  rng = np.random.default_rng(1)
  return [rng.integers(3, 500, n).tolist() for n in (9, 14, 20)]


def _vllm_logits(logits, prompt, output, *, rep=1.0, pres=0.0, freq=0.0, bias=(),
                 banned=(), min_tokens=0):
  """vLLM's processing of one row's logits [V] (float64): logit_bias, min_tokens, then
  repetition on prompt|output ids, frequency and presence on output counts."""
  x = np.array(logits, np.float64)
  for token, value in bias:
    x[token] += value
  if len(output) < min_tokens:
    x[list(banned)] = -np.inf
  counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)
  seen = counts > 0
  seen[list(prompt)] = True
  x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
  return x - freq * counts - pres * (counts > 0)


def _oracle(model, prompt, max_new, eos=None, **processing):
  out = []
  while len(out) < max_new:
    logits = np.asarray(kvjax.forward(model, [prompt + out]))[0, -1]
    token = int(np.argmax(_vllm_logits(logits, prompt, out, **processing)))
    out.append(token)
    if token == eos:
      break
  return out


@pytest.fixture(scope="module", params=[1, 16], ids=["single-step", "burst"])
def engine(request):
  return Engine(_model(), num_scheduler_steps=request.param, **ENGINE)


def _run(eng, prompts, max_new=MAX_NEW, **fields):
  ids = [eng.add_request(p, max_new, **fields) for p in prompts]
  done = {}
  while len(done) < len(ids):
    done.update({o.request_id: o for o in eng.step() if o.finished})
  return [done[i] for i in ids]


def test_apply_matches_vllm_semantics_on_random_logits():
  rng = np.random.default_rng(0)
  b, v = 3, 40
  logits = rng.normal(size=(b, v)).astype(np.float32) * 3
  prompts = [rng.integers(0, v, 6) for _ in range(b)]
  outputs = [rng.integers(0, v, n) for n in (0, 5, 9)]
  rep, pres, freq, min_tokens = [1.3, 0.7, 1.0], [0.5, -0.4, 0.0], [0.2, 1.1, -0.3], [0, 7, 3]
  bias, banned = [(3, 5.0), (7, -100.0)], [1, 2]
  p = LogitProcessing.neutral(b, v).replace(
      min_left=np.array(min_tokens, np.int32), repetition=np.array(rep, np.float32),
      presence=np.array(pres, np.float32), frequency=np.array(freq, np.float32))
  np.testing.assert_array_equal(np.asarray(p.replace(min_left=np.zeros(b, np.int32),
                                repetition=np.ones(b, np.float32), presence=np.zeros(b),
                                frequency=np.zeros(b)).apply(logits)), logits)  # neutral
  for j in range(b):
    for token, value in bias:
      p.bias[j, token] = value
    p.stop_mask[j, banned] = True
    p.prompt_mask[j, prompts[j]] = True
  p = jax.tree.map(jnp.asarray, p).advance(np.full((b, 1), -1)).advance(
      np.array([np.pad(o, (0, 9 - len(o)), constant_values=-1) for o in outputs]))
  got = np.asarray(p.apply(logits))
  for j in range(b):
    want = _vllm_logits(logits[j], prompts[j], outputs[j], rep=rep[j], pres=pres[j],
                        freq=freq[j], bias=bias, banned=banned, min_tokens=min_tokens[j])
    np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("processing", [
    # A random model rarely repeats: penalties that favour repeats change its outputs
    # (repetition_penalty > 1 is checked on random logits above).
    dict(repetition_penalty=0.3), dict(presence_penalty=-1.5, frequency_penalty=0.7),
    dict(frequency_penalty=-0.5, repetition_penalty=0.6), dict(logit_bias={"7": 3.0, 9: -2.5})])
def test_penalties_and_bias_match_the_numpy_oracle(engine, processing):
  prompts = _prompts()
  got = _run(engine, prompts, **processing)
  bias = tuple((int(k), v) for k, v in processing.get("logit_bias", {}).items())
  oracle = dict(rep=processing.get("repetition_penalty", 1.0),
                pres=processing.get("presence_penalty", 0.0),
                freq=processing.get("frequency_penalty", 0.0), bias=bias)
  for prompt, out in zip(prompts, got):
    assert out.output_ids == _oracle(_model(), prompt, MAX_NEW, **oracle)
  # The fields change the outputs, so the comparison above can fail.
  assert any(out.output_ids != _oracle(_model(), p, MAX_NEW) for p, out in zip(prompts, got))
  # Penalized and plain rows share a batch; the plain ones stay plain greedy.
  mixed_ids = [engine.add_request(prompts[0], MAX_NEW, **processing),
               engine.add_request(prompts[1], MAX_NEW)]
  done = {}
  while len(done) < 2:
    done.update({o.request_id: o.output_ids for o in engine.step() if o.finished})
  assert done[mixed_ids[0]] == got[0].output_ids
  assert done[mixed_ids[1]] == _oracle(_model(), prompts[1], MAX_NEW)


def test_ignore_eos_yields_exactly_max_tokens_and_min_tokens_bans_stops():
  prompt = _prompts()[0]
  first = _oracle(_model(), prompt, 1)[0]
  model = _model(eos=first)  # greedy's first token is EOS: a plain request stops at once
  eng = Engine(model, **ENGINE)
  plain, ignored, at_least = (_run(eng, [prompt], MAX_NEW, **f)[0] for f in (
      {}, dict(ignore_eos=True), dict(min_tokens=5)))
  assert plain.output_ids == [first] and plain.finish_reason == "stop"
  assert len(ignored.output_ids) == MAX_NEW and ignored.finish_reason == "length"
  assert ignored.output_ids == _oracle(model, prompt, MAX_NEW)
  assert at_least.output_ids == _oracle(model, prompt, MAX_NEW, eos=first, banned=[first],
                                        min_tokens=5)
  assert len(at_least.output_ids) >= 5 and first not in at_least.output_ids[:5]
  # stop_token_ids still end an ignore_eos request.
  stop = ignored.output_ids[3]
  stopped = _run(eng, [prompt], MAX_NEW, ignore_eos=True, stop=stop)[0]
  assert stopped.output_ids == ignored.output_ids[:ignored.output_ids.index(stop) + 1]


@pytest.mark.parametrize("field, value, words", [
    ("repetition_penalty", 0.0, "repetition_penalty must be in [1e-06, 1e+06]"),
    ("repetition_penalty", 1e300, "repetition_penalty must be in [1e-06, 1e+06]"),
    ("temperature", 1e308, "temperature must be in [0, 3.4028235e+38]"),
    ("min_p", -1, "min_p must be in [0, 1]"),
    ("min_p", "x", "min_p must be a number"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", float("nan"), "frequency_penalty must be finite"),
    ("min_tokens", 9, "min_tokens (9) must be <= max_tokens (8)"),
    ("ignore_eos", 1, "ignore_eos must be a boolean"),
    ("logit_bias", {"512": 1.0}, "logit_bias token id must be in [0, 512)"),
    ("logit_bias", {"3": 101}, "logit_bias['3'] must be in [-100, 100]")])
def test_bad_fields_are_refused_naming_them(field, value, words):
  eng = Engine(_model(), **ENGINE)
  with pytest.raises(ValueError, match=None) as error:
    eng.add_request([1, 2, 3], MAX_NEW, **{field: value})
  assert words in str(error.value)
  assert not eng.has_unfinished


def test_sampled_rows_are_processed_before_temperature_and_top_p(engine):
  # +100 on id 7 leaves every other id e^-100 of its mass: sampling always draws 7;
  # the logprobs stay the model's raw ones (vLLM's default), where 7 is no favourite.
  out = _run(engine, _prompts()[:2], temperature=1.0, top_p=0.9, seed=5, logprobs=1,
             logit_bias={"7": 100}, min_tokens=2)
  for o in out:
    assert o.output_ids == [7] * MAX_NEW
  raw = np.asarray(kvjax.forward(_model(), [_prompts()[0]]))[0, -1].astype(np.float64)
  want = raw[7] - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
  eng = Engine(_model(), **ENGINE)
  rid = eng.add_request(_prompts()[0], 1, logit_bias={"7": 100}, logprobs=1)
  first = [o for o in eng.stream() if o.request_id == rid][-1]
  assert first.new_logprobs[0].logprob == pytest.approx(want, abs=1e-4)


def test_min_p_samples_exactly_the_tokens_numpy_keeps():
  """vLLM's min_p: after temperature, tokens whose probability is below min_p x the
  largest are dropped.  Over 160 seeds the sampled first tokens are exactly the set a
  float64 numpy filter keeps (min_p set midway between two probability ratios, so no
  token sits near the bound; each kept token has >= 0.15 of the mass after renormalizing,
  so all of them are drawn)."""
  model, prompt, temperature = _model(), _prompts()[0], 1.0
  logits = np.asarray(kvjax.forward(model, [prompt]), np.float64)[0, -1] / temperature
  ratio = np.exp(logits - logits.max())  # p / p_max
  order = np.sort(ratio)[::-1]
  kept = 5
  min_p = (order[kept - 1] + order[kept]) / 2
  assert order[kept - 1] - order[kept] > 1e-3 and order[kept - 1] > 0.3, order[:5]
  want = set(np.flatnonzero(ratio >= min_p).tolist())
  eng = Engine(model, **ENGINE)
  seeds = range(160)
  sampled = {s: _run(eng, [prompt], 1, temperature=temperature, seed=s, min_p=min_p)[0]
             .output_ids[0] for s in seeds}
  assert set(sampled.values()) == want
  plain = {_run(eng, [prompt], 1, temperature=temperature, seed=s)[0].output_ids[0]
           for s in seeds}
  assert not plain <= want  # the filter changes the draws, so the check above can fail
