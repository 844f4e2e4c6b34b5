"""Constrained decoding (kvjax/constraints): every output of a random model under a
grammar parses and validates.

Oracles: `jsonschema` validates each JSON output against its schema, Python's `re`
fullmatches each regex output, llguidance's own numpy bitmask code applies masks
independently of kvjax's jitted one, and the plain (non-speculative) engine is the
oracle of constrained greedy decoding with n-gram speculation.  A random model
writes arbitrary bytes wherever the grammar lets it: that every output is valid is
the point.
"""
from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

import kvjax
from kvjax.constraints import Constraint
from kvjax.constraints.vocabulary import constraint_book
from kvjax.engine.generate import run_until_finished
from kvjax.model.params import init_params
from kvjax.runtime.sampling import apply_token_mask
from kvjax.runtime.serve_steps import num_compiled
from kvjax.text.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SHAPES = dict(page_size=16, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=160)
MAX_NEW = 140

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                   "n": {"type": "integer", "minimum": -5,
                                                         "maximum": 40}},
                  "required": ["ok", "n"], "additionalProperties": False}},
     "required": ["name", "inner"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                      "score": {"type": "integer", "minimum": 10,
                                                "maximum": 99}},
     "required": ["id", "score"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
               {"type": "string", "enum": ["none", "many"]}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                             "maximum": 9}},
                      "required": ["x"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 3},
]
REF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            "$ref": "#/$defs/a"}
REGEXES = [r"[a-c]{2,5}-[0-9]{1,3}", r"(yes|no|maybe)!"]
CHOICES = ["alpha", "beta", "gamma delta"]


@functools.lru_cache(maxsize=None)
def random_model(mtp: bool = False) -> kvjax.Model:
  """Random 'tiny' (V = 512 > the byte vocabulary's 259: padded ids must stay masked) whose
  EOS is the byte tokenizer's."""
  cfg = kvjax.get_preset("tiny").replace(name="tiny-constrained", eos_token_id=TOK.eos_id,
                                         mtp_num_hidden_layers=2 if mtp else 0)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(3), std=0.2))


def engine(model, **options) -> kvjax.Engine:
  eng = kvjax.Engine(model, **{**SHAPES, **options})
  eng.constraints = constraint_book(TOK, model.config)
  return eng


def run(eng, constraints, *, seed0: int = 0, **sampling) -> list:
  """One request per constraint (prompts differ) -> final RequestOutputs in order."""
  rng = np.random.default_rng(seed0)
  ids = [eng.add_request(rng.integers(0, 256, 6).tolist(), MAX_NEW, constraint=c,
                         seed=seed0 + i, **sampling) for i, c in enumerate(constraints)]
  done, _ = run_until_finished(eng.step, ids)
  return [done[i] for i in ids]


def text_of(out) -> str:
  assert out.finish_reason == "stop", (out.finish_reason, TOK.decode(out.output_ids))
  assert out.output_ids[-1] == TOK.eos_id
  return bytes(out.output_ids[:-1]).decode("utf-8")


@functools.lru_cache(maxsize=None)
def plain_engine():
  return engine(random_model())


def test_apply_token_mask_equals_llguidance_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 2, 77)).astype(np.float32)
  mask = rng.integers(-2**31, 2**31, size=(3, 2, 3), dtype=np.int64).astype(np.int32)
  expected = logits.reshape(6, 77).copy()
  llg_numpy.apply_token_bitmask_inplace(expected, mask.reshape(6, 3))
  got = jax.jit(apply_token_mask)(jnp.asarray(logits), jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(got).reshape(6, 77), expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(temperature):
  outs = run(plain_engine(), [Constraint("json_schema", s) for s in SCHEMAS],
             temperature=temperature)
  for schema, out in zip(SCHEMAS, outs):
    jsonschema.validate(json.loads(text_of(out)), schema)


def test_json_object_regex_and_choice_outputs_match():
  constraints = ([Constraint("json_object")] + [Constraint("regex", r) for r in REGEXES]
                 + [Constraint("choice", CHOICES)])
  outs = run(plain_engine(), constraints, temperature=1.0, seed0=5)
  assert isinstance(json.loads(text_of(outs[0])), dict)
  for regex, out in zip(REGEXES, outs[1:]):
    assert re.fullmatch(regex, text_of(out)), text_of(out)
  assert text_of(outs[-1]) in CHOICES


def test_lark_grammar_output_parses():
  grammar = 'start: num ("+" num)*\nnum: /[1-9][0-9]?/'
  out, = run(plain_engine(), [Constraint("grammar", grammar)], temperature=1.0, seed0=2)
  text = text_of(out)
  assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text), text


def test_unconstrained_requests_alongside_are_unchanged():
  eng = plain_engine()
  prompt = list(range(40, 46))
  alone = eng.generate([prompt], 12).tokens[0]
  rid = eng.add_request(prompt, 12)
  other = eng.add_request(prompt, MAX_NEW, constraint=Constraint("json_schema", SCHEMAS[2]))
  done, _ = run_until_finished(eng.step, [rid, other])
  assert done[rid].output_ids == alone
  jsonschema.validate(json.loads(text_of(done[other])), SCHEMAS[2])


@pytest.mark.parametrize("constraint, message", [
    (Constraint("regex", "a(b"), "unclosed group"),
    (Constraint("grammar", "start: foo"), 'unknown name: "foo"'),
    (Constraint("json_schema", {"type": "array", "contains": {"type": "integer"}}),
     "contains"),
    # Issue 53: these answered "" with finish_reason "stop".
    (Constraint("json_schema", {"$ref": "#"}), "accepts no output"),
    (Constraint("json_schema", REF_LOOP), "accepts no output"),
    (Constraint("grammar", "start: a\na: a"), "accepts no output"),
    (Constraint("grammar", "start: "), "accepts only the empty output"),
])
def test_bad_grammars_are_value_errors_and_change_nothing(constraint, message):
  eng = plain_engine()
  with pytest.raises(ValueError, match=re.escape(message)):
    eng.add_request([1, 2, 3], 4, constraint=constraint)
  assert not eng.has_unfinished and not eng.constraints


# llguidance allows a rule 2,000 alternatives (LLParserLimits.max_items_in_row): past them
# its matcher fails at the first token and then allows only EOS, which ended as "stop".
WIDE = "start: " + " | ".join(f'"item{i}"' for i in range(2500))


def test_a_matcher_that_fails_while_decoding_finishes_its_request_with_error():
  eng = plain_engine()
  prompt = list(range(40, 46))
  alone = eng.generate([prompt], 12).tokens[0]
  rid = eng.add_request(prompt, 12)
  failing = eng.add_request([7, 8, 9], MAX_NEW, constraint=Constraint("grammar", WIDE))
  done, _ = run_until_finished(eng.step, [rid, failing])
  out = done[failing]
  assert out.finish_reason == "error" and "max is 2000" in out.error, out
  assert out.output_ids and "item".startswith(bytes(out.output_ids).decode())  # no EOS
  assert done[rid].output_ids == alone and done[rid].error is None
  assert not eng.constraints.matchers and not eng.constraints.failed


def test_a_constraint_without_a_vocabulary_is_refused():
  eng = kvjax.Engine(random_model(), **SHAPES)
  with pytest.raises(ValueError, match="constraint vocabulary"):
    eng.add_request([1, 2], 4, constraint=Constraint("json_object"))
  with pytest.raises(ValueError, match="choice constraint needs"):
    Constraint("choice", [])


@pytest.mark.parametrize("speculative", ["ngram", "mtp"])
def test_constrained_greedy_with_speculation_equals_without(speculative):
  model = random_model(mtp=speculative == "mtp")
  constraints = [Constraint("json_schema", s) for s in SCHEMAS[:4]]
  plain = run(engine(model, num_scheduler_steps=1), constraints)
  spec = run(engine(model, speculative=speculative, num_draft=2), constraints)
  for schema, a, b in zip(SCHEMAS, plain, spec):
    assert b.output_ids == a.output_ids
    jsonschema.validate(json.loads(text_of(b)), schema)


def test_forced_tokens_are_drafted_and_accepted():
  """A regex that forces every byte: the n-gram engine drafts the forced bytes (its prompt
  holds nothing to look up) and accepts them all, K + 1 tokens a step; plain decoding
  takes a step per token.  Outputs equal, sampled too (a forced token is the only choice)."""
  model, regex, prompt = random_model(), "abcdefghij", [9, 8, 7, 6, 5, 4]
  steps = {}
  for name, options in (("plain", dict(num_scheduler_steps=1)),
                        ("ngram", dict(speculative="ngram", num_draft=4))):
    eng = engine(model, **options)
    rid = eng.add_request(prompt, 20, temperature=1.0, seed=3,
                          constraint=Constraint("regex", regex))
    done, steps[name] = {}, 0
    while eng.has_unfinished:
      steps[name] += 1
      done.update({o.request_id: o for o in eng.step() if o.finished})
    assert text_of(done[rid]) == regex
  # 10 letters + EOS: one prefill step, then ceil(10 / 5) verify steps and EOS at most.
  assert steps["plain"] >= 11 and steps["ngram"] <= 4, steps


def test_sampling_under_a_grammar_has_the_exact_constrained_marginals():
  """Two letters of a-d then EOS at temperature 1: each letter's count within 6 sigma (+3)
  of the float64 constrained marginals, p(x) restricted to the grammar and renormalized."""
  model, n = random_model(), 300
  prompt = [7, 70, 170, 40, 3]
  letters = np.array([ord(c) for c in "abcd"])
  eng = plain_engine()
  ids = [eng.add_request(prompt, 3, temperature=1.0, seed=s,
                         constraint=Constraint("regex", "[a-d]{2}")) for s in range(n)]
  done, _ = run_until_finished(eng.step, ids)
  first = np.array([done[i].output_ids[:2] for i in ids])  # [n, 2]
  assert all(done[i].output_ids[2] == TOK.eos_id for i in ids)

  def restricted(logits):  # float64 softmax over the letters' logits alone
    z = np.asarray(logits, np.float64)[..., letters]
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)

  p0 = restricted(kvjax.forward(model, [prompt])[0, -1])  # [4]
  extended = np.concatenate([np.tile(prompt, (4, 1)), letters[:, None]], 1)
  p1 = p0 @ restricted(kvjax.forward(model, extended)[:, -1])  # [4]
  for k, probs in enumerate((p0, p1)):
    counts = np.array([(first[:, k] == c).sum() for c in letters])
    assert counts.sum() == n
    bound = 6 * np.sqrt(n * probs * (1 - probs)) + 3
    assert np.all(np.abs(counts - n * probs) <= bound), (k, counts, n * probs)


def test_outputs_validate_through_preemption_and_prefix_hits():
  """A pool too small for the requests at once (they preempt and recompute) and repeated
  prompts (prefix hits): greedy outputs equal the roomy engine's and validate."""
  constraints = [Constraint("json_schema", s) for s in SCHEMAS[:4]]
  roomy = run(plain_engine(), constraints, seed0=9)
  tight = engine(random_model(), num_pages=11)  # 10 usable: one request may need all
  for start in (100, 120):  # long unconstrained neighbours crowd the pool
    tight.add_request(list(range(start, start + 6)), 120)
  first = run(tight, constraints, seed0=9)
  again = run(tight, constraints, seed0=9)
  assert tight.scheduler.num_preemptions > 0
  assert tight.scheduler.prefix_cache.hit_tokens > 0
  for schema, a, b, c in zip(SCHEMAS, roomy, first, again):
    assert a.output_ids == b.output_ids == c.output_ids
    jsonschema.validate(json.loads(text_of(b)), schema)


def test_a_constrained_request_after_warm_up_compiles_nothing():
  """Unconstrained groups take the shared all-ones mask, so the warm-up's programs are the
  ones a constrained request runs: its first mask waits on no compile."""
  eng = engine(random_model())
  eng.warm_up()
  before = num_compiled()
  out, = run(eng, [Constraint("regex", REGEXES[1])])
  assert num_compiled() == before
  assert text_of(out) in {"yes!", "no!", "maybe!"}
