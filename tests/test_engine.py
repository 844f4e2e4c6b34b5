"""Engine: outputs equal generate alone, prefix cache, salts, bad input, no page leaks."""
from __future__ import annotations

import chex
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

import kvjax
from kvjax.runtime import serve_steps
from tests import engine_helpers as h

# name: (engine overrides, expect preemption, expect prefix hits)
SCENARIOS = {
    "no_prefix_cache": (dict(prefix_cache=False), False, False),
    "block_match": (dict(prefix_match="block"), False, True),
    "token_match": (dict(prefix_match="token"), False, True),
    # Short prompts grow into a second page while decoding.
    "preempt": (dict(num_pages=h.TINY_POOL), True, True),
    "preempt_no_prefix_cache": (dict(num_pages=h.TINY_POOL, prefix_cache=False), True, False),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_mixed_requests_equal_generate_alone(name):
  overrides, preempts, hits = SCENARIOS[name]
  eng = h.engine(**overrides)
  batch = (h.prompts(5, seed=1, shared=20) + h.prompts(3, seed=2, lengths=(12, 15)))
  finals = h.run_staggered_finals(eng, batch)
  assert [out.output_ids for out in finals] == [h.reference(p) for p in batch]
  assert (eng.scheduler.num_preemptions > 0) == preempts
  hit = sum(out.metrics.prefix_hit_tokens for out in finals)
  assert (hit > 0) == hits
  h.assert_no_pages_held(eng)


@pytest.mark.parametrize("match,expected_hit", [("block", 16), ("token", 20)])
def test_prefix_hit_tokens_block_vs_token(match, expected_hit):
  # C8: a 20-token shared prefix shares one full 16-token block; token mode copies
  # the partial block and reuses all 20.
  first, second = h.prompts(2, seed=3, shared=20)
  first = first + [7] * (33 - len(first))  # two full blocks get cached
  eng = h.engine(prefix_match=match)
  assert eng.generate([first], 2).stats["prefix_hit_tokens"] == 0
  result = eng.generate([second], h.MAX_NEW)
  assert result.stats["prefix_hit_tokens"] == expected_hit
  assert result.tokens == [h.reference(second)]
  h.assert_no_pages_held(eng)


def test_salted_requests_never_share_blocks():
  prompt = h.prompts(1, seed=4)[0]
  eng = h.engine()
  assert eng.generate([prompt], h.MAX_NEW, cache_salt="a").stats["prefix_hit_tokens"] == 0
  assert eng.generate([prompt], h.MAX_NEW, cache_salt="b").stats["prefix_hit_tokens"] == 0
  assert eng.generate([prompt], h.MAX_NEW).stats["prefix_hit_tokens"] == 0
  # Concurrently: salt "a" reuses its cached block; unseen salts "d", "e" share nothing.
  ids = {salt: eng.add_request(prompt, h.MAX_NEW, cache_salt=salt) for salt in "ade"}
  eng.step()
  pages = {salt: set(eng.scheduler.requests[rid].pages) for salt, rid in ids.items()}
  assert not pages["a"] & pages["d"] and not pages["d"] & pages["e"]
  assert not pages["a"] & pages["e"]
  assert eng.scheduler.requests[ids["a"]].num_cached_tokens == 16
  assert all(eng.scheduler.requests[ids[s]].num_cached_tokens == 0 for s in "de")
  finals = h.run_to_end(eng)
  assert all(finals[rid].output_ids == h.reference(prompt) for rid in ids.values())
  h.assert_no_pages_held(eng)


BAD_REQUESTS = {
    "empty prompt": (([], h.MAX_NEW), "non-empty"),
    "id >= vocab": (([5, 512, 7], h.MAX_NEW), "token id 512"),
    "negative id": (([5, -1], h.MAX_NEW), "token id -1"),
    "zero new tokens": (([5, 6], 0), "max_new_tokens must be a positive int"),
    "longer than context": (([5] * 60, 8), "exceeds max_model_len 64"),
    "more pages than exist": (([5] * 50, 8), "needs up to 4 KV pages but the pool has 3"),
}


def test_bad_requests_fail_alone_and_others_finish_unchanged():
  eng = h.engine(num_pages=h.TINY_POOL)
  batch = h.prompts(3, seed=5)
  ids = [eng.add_request(p, h.MAX_NEW) for p in batch]
  eng.step()
  for name, ((prompt, max_new), message) in BAD_REQUESTS.items():
    with pytest.raises(ValueError, match=message):
      eng.add_request(prompt, max_new)
    eng.step()
  finals = h.run_to_end(eng)
  assert [finals[rid].output_ids for rid in ids] == [h.reference(p) for p in batch]
  h.assert_no_pages_held(eng)


def test_an_idle_engine_that_admits_nothing_raises_instead_of_spinning(monkeypatch):
  eng = h.engine()
  eng.add_request(h.prompts(1, seed=71)[0], 2)
  monkeypatch.setattr(eng.scheduler, "_admission", lambda *args: None)
  with pytest.raises(RuntimeError, match="admitted none of 1 waiting requests"):
    eng.step()


def test_generate_validates_every_prompt_before_queueing():
  eng = h.engine()
  with pytest.raises(ValueError, match="prompt 1 has token id 999"):
    eng.generate([[5, 6, 7], [999]], 4)
  assert not eng.has_unfinished and not eng.metrics


def test_generate_hands_other_requests_outputs_to_the_next_step():
  eng = h.engine()
  mine, theirs = h.prompts(2, seed=61)
  rid = eng.add_request(theirs, h.MAX_NEW)
  assert eng.generate([mine], h.MAX_NEW).tokens == [h.reference(mine)]
  streamed, finals = [], {}
  for out in eng.stream():
    assert out.request_id == rid
    streamed += out.new_token_ids
    if out.finished:
      finals[rid] = out
  assert streamed == finals[rid].output_ids == h.reference(theirs)
  assert finals[rid].metrics.output_len == h.MAX_NEW
  assert not eng.has_unfinished and not eng.metrics


def test_stream_and_abort():
  eng = h.engine()
  batch = h.prompts(3, seed=6)
  ids = [eng.add_request(p, h.MAX_NEW) for p in batch]
  streamed = {rid: [] for rid in ids}
  reasons = {}
  for i, out in enumerate(eng.stream()):
    streamed[out.request_id] += out.new_token_ids
    assert out.output_ids == streamed[out.request_id]
    if out.finished:
      reasons[out.request_id] = out.finish_reason
    if i == 4:
      assert eng.abort(ids[1])
      assert ids[1] not in eng.metrics and eng.has_unfinished
  assert streamed[ids[0]] == h.reference(batch[0])
  assert streamed[ids[2]] == h.reference(batch[2])
  assert streamed[ids[1]] == h.reference(batch[1])[:len(streamed[ids[1]])]
  assert reasons == {ids[0]: "length", ids[1]: "abort", ids[2]: "length"}
  assert not eng.abort(ids[1])
  h.assert_no_pages_held(eng)


def test_kvjax_generate_runs_a_one_shot_engine_with_engine_keywords():
  model = h.mtp_model()
  batch = h.prompts(3, seed=7, shared=18)
  result = kvjax.generate(model, batch, h.MAX_NEW, prefix_cache=True, **h.ENGINE_DEFAULTS)
  assert result.tokens == [h.reference(p) for p in batch]
  for key in ("ttft_s", "tpot_s", "tokens_per_s", "kv_pages_used", "prefix_hit_tokens",
              "prefix_hit_rate", "acceptance_length", "num_preemptions"):
    assert key in result.stats
  with pytest.raises(ValueError, match="cache='paged'"):
    kvjax.generate(model, batch, 4, cache="contiguous", speculative="mtp")


_HYPOTHESIS_PROMPTS = h.prompts(4, seed=8, shared=16) + [[9] * 3, [11] * 40]


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step"]),
                                     st.integers(0, 20)), min_size=1, max_size=25))
def test_random_add_abort_step_keeps_invariants_and_never_leaks(ops):
  eng = _HYPOTHESIS_ENGINE[0]
  live = []
  for op, arg in ops:
    if op == "add":
      live.append(eng.add_request(_HYPOTHESIS_PROMPTS[arg % len(_HYPOTHESIS_PROMPTS)],
                                  1 + arg % 9))
    elif op == "abort" and live:
      eng.abort(live.pop(arg % len(live)))
    else:
      eng.step()
    eng.scheduler.check_invariants()
  for rid in list(eng.scheduler.requests):
    assert eng.abort(rid)
  h.assert_no_pages_held(eng)


_HYPOTHESIS_ENGINE = [h.engine(num_pages=h.TINY_POOL, prefix_match="token")]


def test_engine_compiles_a_bounded_number_of_steps(monkeypatch):
  # A fresh config name: only this test's compiles count.  4 rows (one row bucket),
  # prefill chunks of 16, decode rows of 1: 2 step programs and 1 multi-step decode
  # loop, however long the prompts.
  model = h.mtp_model()
  fresh = kvjax.Model(model.config.replace(name="trace-count-engine"), model.params)
  eng = kvjax.Engine(fresh, **h.ENGINE_DEFAULTS)
  before = serve_steps.serve_step._cache_size(), serve_steps.serve_burst._cache_size()
  monkeypatch.setattr(serve_steps, "model_step",
                      chex.assert_max_traces(serve_steps.model_step, n=3))
  for n in (1, 5, 9, 30):
    eng.generate([[7] * n, list(range(3, 3 + n))], 5)
  assert serve_steps.serve_step._cache_size() - before[0] == 2
  assert serve_steps.serve_burst._cache_size() - before[1] == 1
  assert max(eng.steps.num_steps) > 1


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_multi_step_bursts_equal_single_steps(speculative):
  # Bursts change when tokens reach the host, never which: greedy, stop-token and
  # sampled (top-k, top-p) requests, plain and drafting, acceptance counted alike.
  batch = h.prompts(4, seed=41)
  stop = h.reference(batch[1])[3]
  want_stopped = h.reference(batch[1])[:h.reference(batch[1]).index(stop) + 1]
  requests = [dict(), dict(stop=stop), dict(temperature=1.0, top_k=20, seed=3),
              dict(temperature=0.7, top_p=0.9, seed=4)]
  runs = {}
  for steps in (1, 16):
    eng = h.engine(speculative=speculative, num_scheduler_steps=steps)
    ids = [eng.add_request(p, h.MAX_NEW, **kw) for p, kw in zip(batch, requests)]
    finals = h.run_to_end(eng)
    h.assert_no_pages_held(eng)
    assert (max(eng.steps.num_steps) > 1) == (steps > 1)
    runs[steps] = [(finals[r].output_ids, finals[r].metrics.proposed,
                    finals[r].metrics.accepted) for r in ids]
  assert runs[1] == runs[16]
  outputs = [out for out, _, _ in runs[16]]
  assert outputs[0] == h.reference(batch[0]) and outputs[1] == want_stopped
  assert all(len(out) == h.MAX_NEW for out in outputs[2:])
  assert (sum(sum(p) for _, p, _ in runs[16]) > 0) == (speculative is not None)


def test_long_prefill_chunks_pad_few_rows():
  # Padding rows cost t tokens each: 2 rows of 64-token chunks run as 2 rows
  # (<= 128 padding tokens), 2 rows of 16-token chunks as 8 (fewer shapes).
  eng = h.engine(max_num_seqs=8, max_num_batched_tokens=128, num_scheduler_steps=1)
  for lengths, prefill_shape in (((40, 48), (2, 64)), ((9, 12), (8, 16))):
    batch = h.prompts(2, seed=51, lengths=lengths)
    mark = eng.steps.num_recorded
    assert eng.generate(batch, 2).tokens == [h.reference(p)[:2] for p in batch]
    # one prefill step, one decode step
    assert eng.steps.since(mark).row_shapes == [(prefill_shape,), ((8, 1),)]


def test_mtp_kv_layers_are_allocated_only_when_drafting():
  # C11: the MTP modules' KV is speculation's memory cost, not a plain decoder's.
  model = h.mtp_model()
  cfg = model.config
  assert cfg.mtp_num_hidden_layers > 0
  plain = kvjax.Engine(model, **h.ENGINE_DEFAULTS)
  drafting = kvjax.Engine(model, speculative="mtp", **h.ENGINE_DEFAULTS)
  assert plain.state.cache.k_pages.shape[0] == cfg.num_layers
  assert drafting.state.cache.k_pages.shape[0] == cfg.num_layers + cfg.mtp_num_hidden_layers
  batch = h.prompts(2, seed=31)
  assert plain.generate(batch, h.MAX_NEW).tokens == [h.reference(p) for p in batch]
