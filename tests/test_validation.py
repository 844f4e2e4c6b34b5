"""One validation of request parameters (issue 12's repros): every bad value is refused at
add time with a ValueError naming the field, nothing is queued, and the requests around it
finish unchanged; kvjax.generate applies the same checks."""
from __future__ import annotations

import math

import pytest

import kvjax
from tests import engine_helpers as h

# name: (add_request keywords, fragment of the error) on the tiny-mtp model (vocab 512).
BAD = {
    "seed_negative": (dict(seed=-1), "seed must be in"),
    "seed_2_32": (dict(seed=2**32), "seed must be in"),
    "seed_float": (dict(seed=1.7), "seed must be an int"),
    "top_k_huge": (dict(top_k=2**31), "top_k must be in"),
    "top_k_float": (dict(top_k=1.5), "top_k must be an int"),
    "stop_huge": (dict(stop=[2**31]), "stop must be in"),
    "stop_outside_vocab": (dict(stop=1000), "stop must be in"),
    "stop_negative": (dict(stop=[-5]), "stop must be in"),
    "stop_float": (dict(stop=[1.5]), "stop must be an int"),
    "stop_string": (dict(stop="a"), "stop must be a token id"),
    "temperature_nan": (dict(temperature=math.nan), "temperature must be finite"),
    "temperature_inf": (dict(temperature=math.inf), "temperature must be finite"),
    "temperature_none": (dict(temperature=None), "temperature must be a number"),
    "temperature_string": (dict(temperature="0.5"), "temperature must be a number"),
    "top_p_nan": (dict(top_p=math.nan), "top_p must be finite"),
    "max_new_tokens_bool": (dict(max_new_tokens=True), "max_new_tokens must be an int"),
}
# Issue 53 item 3: every argument of add_request with a bad value (the tiny-mtp engine
# speculates, so the extensions' own checks come before its "needs no speculation").
EVERY_ARGUMENT = {
    "prompt": (dict(prompt=[[1], [1, 2]]), "prompt must be"),
    "prompt_outside_vocab": (dict(prompt=[1, 512]), "prompt token id 512 outside"),
    "max_new_tokens": (dict(max_new_tokens="4"), "max_new_tokens must be an int"),
    "temperature": (dict(temperature="x"), "temperature must be a number"),
    "top_k": (dict(top_k=-1), "top_k must be in"),
    "top_p": (dict(top_p=0), "top_p must be in"),
    "seed": (dict(seed="x"), "seed must be an int"),
    "stop": (dict(stop=[None]), "stop must be an int"),
    "cache_salt": (dict(cache_salt=["a"]), "cache_salt must be a string"),
    "logprobs": (dict(logprobs=21), "logprobs must be in"),
    "arrival_s": (dict(arrival_s="x"), "arrival_s must be a number"),
    "arrival_s_nan": (dict(arrival_s=math.nan), "arrival_s must be finite"),
    "constraint": (dict(constraint="json"), "constraint"),
    "ignore_eos": (dict(ignore_eos=1), "ignore_eos must be a boolean"),
    "min_tokens": (dict(min_tokens=-1), "min_tokens must be"),
    "repetition_penalty": (dict(repetition_penalty=0), "repetition_penalty must be in"),
    "min_p": (dict(min_p=2), "min_p must be in"),
    "presence_penalty": (dict(presence_penalty=3), "presence_penalty must be in"),
    "frequency_penalty": (dict(frequency_penalty="x"), "frequency_penalty must be a number"),
    "logit_bias": (dict(logit_bias=[1]), "logit_bias must be an object"),
    "unknown_keyword": (dict(foo=1), r"unknown request option\(s\) \['foo'\]"),
}


@pytest.mark.parametrize("cases", [BAD, EVERY_ARGUMENT], ids=["issue12", "every_argument"])
def test_every_bad_value_is_refused_by_name_and_queues_nothing(cases):
  eng = h.engine()
  batch = h.prompts(2, seed=71)
  ids = [eng.add_request(p, h.MAX_NEW) for p in batch]
  finals = {}
  for name, (kwargs, fragment) in cases.items():
    kwargs = {"prompt": batch[0], "max_new_tokens": h.MAX_NEW, **kwargs}
    before = (set(eng.scheduler.requests), set(eng.metrics), len(eng.scheduler.waiting))
    with pytest.raises(ValueError, match=fragment):
      eng.add_request(**kwargs)
    assert (set(eng.scheduler.requests), set(eng.metrics),
            len(eng.scheduler.waiting)) == before, name
    # a step after every refusal still runs
    finals.update({out.request_id: out for out in eng.step() if out.finished})
  finals.update(h.run_to_end(eng))
  assert [finals[rid].output_ids for rid in ids] == [h.reference(p) for p in batch]
  h.assert_no_pages_held(eng)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(top_p=math.nan), "top_p must be finite"), (dict(temperature=math.nan), "finite"),
    (dict(seed=-1), "seed must be in"), (dict(top_k=10**6), "top_k must be in")])
def test_generate_applies_the_same_checks(tiny_model, kwargs, fragment):
  with pytest.raises(ValueError, match=fragment):
    kvjax.generate(tiny_model, [[1, 2, 3]], 2, **kwargs)


def test_abort_of_a_non_string_id_is_a_value_error_and_changes_nothing():
  eng = h.engine()
  rid = eng.add_request([5, 6, 7], 2)
  for bad in ([1], 1, None):
    with pytest.raises(ValueError, match="request_id must be a string"):
      eng.abort(bad)
  assert not eng.abort("no such id")
  assert list(h.run_to_end(eng)) == [rid]


def test_well_formed_edges_are_accepted():
  eng = h.engine()
  vocab = eng.model_config.vocab_size
  for kwargs in (dict(seed=2**32 - 1), dict(top_k=vocab), dict(stop=vocab - 1),
                 dict(temperature=0), dict(top_p=1)):
    eng.add_request([5, 6, 7], 2, **kwargs)
  assert len(h.run_to_end(eng)) == 5
