"""Issue 12's threading contract and wide-input proof: one Engine shared by two threads
(adds, steps, aborts, concurrent generate calls) stays consistent and gives every request
its single-thread output; requests drawn from wide parameter strategies are refused at
add time exactly when an independent statement of the rules says they are bad, and the
well-formed ones are unaffected by the refusals around them."""
from __future__ import annotations

import math
import numbers
import random
import threading

import hypothesis
from hypothesis import strategies as st
import pytest

from tests import engine_helpers as h

PROMPTS = h.prompts(6, seed=31)
VOCAB = h.mtp_model().config.vocab_size


def _single_thread_outputs(requests):
  """Oracle: each (prompt, kwargs) run alone through a fresh engine, in order."""
  eng = h.engine()
  ids = [eng.add_request(p, h.MAX_NEW, **kw) for p, kw in requests]
  finals = h.run_to_end(eng)
  return [finals[rid].output_ids for rid in ids]


REQUESTS = [(p, dict(temperature=0.8, seed=i) if i % 2 else {}) for i, p in enumerate(PROMPTS)]


def test_two_threads_hammering_one_engine():
  eng = h.engine()
  want = _single_thread_outputs(REQUESTS)
  finals, errors, added = {}, [], {}  # request id -> request index
  added_lock = threading.Lock()  # the test's own bookkeeping, not the engine's

  def worker(index: int):
    rng = random.Random(index)
    mine = list(range(index, len(REQUESTS), 2))
    try:
      for _ in range(60):  # bounded: at most 60 operations per thread
        op = rng.choice(["add", "step", "step", "abort"] if mine else ["step", "abort"])
        if op == "add":
          i = mine.pop(0)
          prompt, kwargs = REQUESTS[i]
          rid = eng.add_request(prompt, h.MAX_NEW, **kwargs)
          with added_lock:
            added[rid] = i
        elif op == "abort" and added and rng.random() < 0.2:
          with added_lock:
            victim = rng.choice(sorted(added))
          eng.abort(victim)
        else:
          for out in eng.step():
            if out.finished:
              assert out.request_id not in finals
              finals[out.request_id] = out
    except Exception as error:  # noqa: BLE001 - reported below, with its thread
      errors.append((index, error))

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  assert not any(t.is_alive() for t in threads) and not errors, errors
  finals.update(h.run_to_end(eng))
  assert set(finals) == set(added)
  for rid, i in added.items():
    out = finals[rid]
    if out.finish_reason == "abort":
      assert out.output_ids == want[i][:len(out.output_ids)]
    else:
      assert out.output_ids == want[i], (rid, i)
  h.assert_no_pages_held(eng)


def test_concurrent_generate_calls_equal_single_thread_ones():
  eng = h.engine()
  halves = [REQUESTS[:3], REQUESTS[3:]]
  results = [None, None]

  def call(k):
    results[k] = eng.generate([p for p, _ in halves[k]], h.MAX_NEW, temperature=0.8,
                              seed=[7 + i for i in range(3)])

  threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  for k in range(2):
    want = _single_thread_outputs([(p, dict(temperature=0.8, seed=7 + i))
                                   for i, (p, _) in enumerate(halves[k])])
    assert results[k].tokens == want
  h.assert_no_pages_held(eng)


# -- wide parameter strategies --------------------------------------------------------

WILD = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.none(), st.text(max_size=3), st.booleans(),
                 st.sampled_from([0, 1, 3, 0.5, 1.0, 2**32 - 1, 2**32, VOCAB, VOCAB - 1]))


def _is_int(x) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_finite_real(x) -> bool:
  return (isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x))


def _well_formed(prompt, max_new, kw) -> bool:
  """The documented rules (Engine.add_request), written independently of kvjax."""
  t, k, p, s, stop = (kw.get(n) for n in ("temperature", "top_k", "top_p", "seed", "stop"))
  stops = stop if isinstance(stop, list) else [stop] if stop is not None else []
  return (_is_int(max_new) and max_new >= 1 and len(prompt) + max_new <= 64
          and _is_finite_real(t) and t >= 0
          and (k is None or (_is_int(k) and 0 <= k <= VOCAB))
          and (p is None or (_is_finite_real(p) and 0 < p <= 1))
          and (s is None or (_is_int(s) and 0 <= s < 2**32))
          and all(_is_int(x) and 0 <= x < VOCAB for x in stops))


REQUEST = st.tuples(
    st.sampled_from(range(len(PROMPTS))),
    st.one_of(st.integers(-3, 10), st.sampled_from([True, 2.0, None, "4", 2**40])),
    st.fixed_dictionaries({}, optional={
        "temperature": st.one_of(WILD, st.floats(0, 2)), "top_k": WILD,
        "top_p": st.one_of(WILD, st.floats(0.05, 1)), "seed": WILD,
        "stop": st.one_of(WILD, st.lists(WILD, max_size=2))}))


@hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(st.lists(REQUEST, min_size=1, max_size=6))
def test_wild_parameters_are_refused_at_add_time_and_harm_no_one(requests):
  eng = h.engine()
  good, finals = [], {}
  for index, max_new, kw in requests:
    kw = {"temperature": 0.0, **kw}
    prompt = PROMPTS[index]
    if _well_formed(prompt, max_new, kw):
      good.append((eng.add_request(prompt, max_new, **kw), prompt, max_new, kw))
    else:
      before = set(eng.scheduler.requests)
      with pytest.raises(ValueError):
        eng.add_request(prompt, max_new, **kw)
      assert set(eng.scheduler.requests) == before
      # a step after every refusal still runs
      finals.update({out.request_id: out for out in eng.step() if out.finished})
  finals.update(h.run_to_end(eng))
  # The oracle engine never sees a bad request.
  clean = h.engine()
  ids = [clean.add_request(p, n, **kw) for _, p, n, kw in good]
  want = h.run_to_end(clean)
  for (rid, *_), clean_id in zip(good, ids):
    assert finals[rid].output_ids == want[clean_id].output_ids
  h.assert_no_pages_held(eng)


def test_arrival_time_given_by_a_server_counts_in_ttft():
  import time

  eng = h.engine()
  early = eng.add_request(PROMPTS[0], 2, arrival_s=time.perf_counter() - 5.0)
  late = eng.add_request(PROMPTS[1], 2, arrival_s=time.perf_counter() + 60.0)  # clamped
  finals = h.run_to_end(eng)
  assert finals[early].metrics.ttft_s >= 5.0
  assert 0 <= finals[late].metrics.ttft_s < 5.0
