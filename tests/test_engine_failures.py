"""Defense in depth (issue 12): a request whose logits go non-finite finishes with
finish_reason "error" while every other request, in the same step and later on the
same pages, gets exactly its oracle output; broken draft distributions are rejections,
never token 0s.  Oracles: kvjax.generate (the static path) and the verifier's
reference with the drafts it should have kept."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.runtime import speculative
from kvjax.runtime.sampling import SamplingParams
from tests import engine_helpers as h

CLEAN = h.prompts(4, seed=91)
# The prompt that will break: its 3rd greedy token gets a NaN embedding row, so it
# prefills fine and fails mid-decode (inside a multi-step burst when bursts are on).
VICTIM = h.prompts(1, seed=92)[0]


@functools.lru_cache(maxsize=None)
def broken_model():
  """mtp_model with embed[bad] = NaN for a token only VICTIM's decode ever feeds."""
  model = h.mtp_model()
  used = {t for p in CLEAN for t in h.reference(p)} | set(VICTIM)
  bad = next(t for t in h.reference(VICTIM)[2:] if t not in used)
  params = model.params.replace(embed=model.params.embed.at[bad].set(jnp.nan))
  return kvjax.Model(model.config, params), bad


def _oracle(prompt):
  """Greedy ids kvjax.generate makes on the broken model (clean prompts never touch
  the NaN row)."""
  return kvjax.generate(broken_model()[0], [prompt], h.MAX_NEW).tokens[0]


@pytest.mark.parametrize("options", [dict(num_scheduler_steps=1), dict(num_scheduler_steps=4)],
                         ids=["single_step", "burst"])
def test_a_nonfinite_request_errors_alone_and_leaves_clean_pages(options):
  model, bad = broken_model()
  # A 2-usable-page pool: every later request reuses the failed request's pages, and a
  # short one leaves the broken position masked but unwritten, where 0 * NaN would show.
  eng = kvjax.Engine(model, **{**h.ENGINE_DEFAULTS, "num_pages": 3, **options})
  clean_ids = [eng.add_request(CLEAN[0], h.MAX_NEW)]
  victim = eng.add_request(VICTIM, h.MAX_NEW)
  finals = h.run_to_end(eng)
  # It keeps what it emitted up to the broken token (sampled from finite logits).
  want = h.reference(VICTIM)
  assert finals[victim].finish_reason == "error"
  assert finals[victim].output_ids == want[:want.index(bad) + 1]
  # Later requests run on the pages (and the slot) the failed request left behind.
  later = [CLEAN[1][:5], CLEAN[2], CLEAN[3][:7]]
  for prompt in later:
    clean_ids.append(eng.add_request(prompt, h.MAX_NEW))
    finals.update(h.run_to_end(eng))
  for rid, prompt in zip(clean_ids, CLEAN[:1] + later):
    assert finals[rid].finish_reason == "length"
    assert finals[rid].output_ids == _oracle(prompt), rid
  h.assert_no_pages_held(eng)


def test_with_mtp_a_request_never_gets_a_wrong_token():
  # Drafts feed tokens too: a request whose drafter proposes the broken token errors
  # (module doc of kvjax/engine/engine.py), but no request ever gets a token its oracle lacks.
  model, _ = broken_model()
  eng = kvjax.Engine(model, **{**h.ENGINE_DEFAULTS, "num_pages": h.TINY_POOL},
                     speculative="mtp", num_draft=2)
  ids = [eng.add_request(p, h.MAX_NEW) for p in (CLEAN[0], VICTIM)]
  finals = h.run_to_end(eng)
  for prompt in CLEAN[1:]:
    ids.append(eng.add_request(prompt, h.MAX_NEW))
    finals.update(h.run_to_end(eng))
  assert finals[ids[1]].finish_reason == "error"
  for rid, prompt in zip(ids[:1] + ids[2:], CLEAN):
    out, want = finals[rid], _oracle(prompt)
    assert out.output_ids == want[:len(out.output_ids)], rid
    assert out.finish_reason == "length" or out.finish_reason == "error", rid
  assert sum(finals[rid].finish_reason == "length" for rid in ids) >= 2
  h.assert_no_pages_held(eng)


def test_generate_reports_the_error_finish():
  eng = kvjax.Engine(broken_model()[0], **h.ENGINE_DEFAULTS)
  result = eng.generate([CLEAN[0], VICTIM], h.MAX_NEW)
  assert result.stats["finish_reasons"] == ["length", "error"]
  assert result.tokens[0] == _oracle(CLEAN[0])


def test_the_failed_requests_blocks_leave_the_prefix_cache():
  model, _ = broken_model()
  eng = kvjax.Engine(model, **h.ENGINE_DEFAULTS)
  victim = eng.add_request(VICTIM, h.MAX_NEW)
  assert h.run_to_end(eng)[victim].finish_reason == "error"
  assert eng.scheduler.prefix_cache.num_cached_pages == 0
  # The same prompt again computes afresh (and fails again) instead of hitting NaN pages.
  again = eng.add_request(VICTIM, h.MAX_NEW)
  out = h.run_to_end(eng)[again]
  assert out.finish_reason == "error" and out.metrics.prefix_hit_tokens == 0


@functools.lru_cache(maxsize=None)
def _nan_keys_model():
  """mtp_model whose first layer's K projection is NaN: the NaN reaches the logits only
  through the K/V pages (a forward without a cache is NaN everywhere)."""
  model = h.mtp_model()
  first = model.params.blocks[0]
  first = first.replace(attn=first.attn.replace(wk=jnp.full_like(first.attn.wk, jnp.nan)))
  return kvjax.Model(model.config, model.params.replace(blocks=(first,) + model.params.blocks[1:]))


@pytest.mark.parametrize("kv_dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow),
                                      pytest.param("fp16", marks=pytest.mark.slow), "int8",
                                      "int4"])
def test_nan_keys_error_under_every_kv_dtype(kv_dtype):
  # Issue 33: int8 pages quantized NaN keys to finite codes, so the request finished
  # "length" and its blocks stayed in the prefix cache; int4 gave the static path 0s.
  model = _nan_keys_model()
  assert not np.isfinite(np.asarray(kvjax.forward(model, np.array([CLEAN[0]])))).any()
  eng = kvjax.Engine(model, **h.ENGINE_DEFAULTS, kv_dtype=kv_dtype)
  rid = eng.add_request(CLEAN[0], h.MAX_NEW)  # 17+ tokens: one full page to cache
  out = h.run_to_end(eng)[rid]
  assert (out.finish_reason, out.output_ids) == ("error", [])
  assert eng.scheduler.prefix_cache.num_cached_pages == 0
  h.assert_no_pages_held(eng)
  result = kvjax.generate(model, [CLEAN[0]], h.MAX_NEW, kv_dtype=kv_dtype)
  assert (result.tokens, result.stats["finish_reasons"]) == ([[]], ["error"])


@pytest.mark.parametrize("cache", ["paged", "contiguous", "none"])
def test_static_generate_reports_the_error_finish(cache):
  # Issue 33: the static path had no finish reasons; a NaN mid-decode now ends the row
  # with "error" after the tokens sampled from finite logits, as the Engine does.
  model, bad = broken_model()
  result = kvjax.generate(model, [CLEAN[0], VICTIM], h.MAX_NEW, cache=cache)
  want = h.reference(VICTIM)
  assert result.stats["finish_reasons"] == ["length", "error"]
  assert result.tokens == [h.reference(CLEAN[0]), want[:want.index(bad) + 1]]


# -- broken draft distributions ----------------------------------------------------------

def _nan_mtp_model():
  model = h.mtp_model()
  mtp = model.params.mtp
  broken = mtp[1].replace(proj=jnp.full_like(mtp[1].proj, jnp.nan))
  return kvjax.Model(model.config, model.params.replace(mtp=(mtp[0], broken)))


def test_nonfinite_drafts_are_rejected_not_emitted():
  model = _nan_mtp_model()
  eng = kvjax.Engine(model, **h.ENGINE_DEFAULTS, speculative="mtp", num_draft=2)
  greedy = eng.generate(CLEAN[:2], h.MAX_NEW)
  assert greedy.tokens == [_oracle(p) for p in CLEAN[:2]]  # greedy stays exact
  sampled = h.run_staggered_finals(eng, CLEAN[:2], temperature=0.9, seed=5)
  for out in sampled:
    assert out.finish_reason == "length" and len(out.output_ids) == h.MAX_NEW
    ids = np.asarray(out.output_ids)
    assert ((ids >= 0) & (ids < model.config.vocab_size)).all()
    # The second draft is always broken: at most the first one is ever accepted.
    assert out.metrics.accepted[1] == 0 and out.metrics.proposed[1] > 0


def test_accept_treats_a_nonfinite_draft_as_the_end_of_the_drafts():
  b, j, v = 3, 3, 11
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(b, j + 1, v)) * 2, jnp.float32)
  drafts = jnp.asarray(rng.integers(0, v, (b, j)), jnp.int32)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, j, v)), jnp.float32), axis=-1)
  broken = probs.at[0, 1, 4].set(jnp.nan).at[1, 0, :].set(jnp.inf)  # row 2 stays clean
  num_draft = jnp.array([3, 3, 3], jnp.int32)
  sampling = SamplingParams.make(b, temperature=[0.7, 1.0, 1.3], seeds=[1, 2, 3])
  positions = jnp.array([10, 20, 30], jnp.int32)
  backend = get_backend("reference")
  tokens, accepted = speculative.accept(logits, drafts, broken, num_draft, sampling,
                                        positions, backend)
  # The oracle: the same draw verifying only the drafts before the broken one.
  want_tokens, want_accepted = speculative.accept(
      logits, drafts, probs, jnp.array([1, 0, 3], jnp.int32), sampling, positions, backend)
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_array_equal(accepted, want_accepted)
  assert int(accepted[0]) <= 1 and int(accepted[1]) == 0


def test_nan_temperature_with_mtp_is_refused_not_sixteen_zeros():
  # Issue 12's repro 3: Engine(m, speculative="mtp").generate([p], 16, temperature=nan).
  eng = kvjax.Engine(h.mtp_model(), **h.ENGINE_DEFAULTS, speculative="mtp", num_draft=2)
  with pytest.raises(ValueError, match="temperature must be finite"):
    eng.generate([CLEAN[0]], 16, temperature=float("nan"))
  assert not eng.scheduler.requests
