"""Pages released from a monotone variant's mask (kvjax/engine/sched/mask_release.py).

The oracle is a brute force over positions written here: a written page (all its keys
before s) is dead at s iff no query at any position q in [s, max_model_len) sees any of
its keys, in any layer (mask(q, k) and k <= q, evaluated one position pair at a time).
It assumes no monotonicity, so it also checks that the built-ins keep their promise.
Tokens are compared with the no-cache greedy under the same variant (which
tests/test_attention_variants.py holds to a float64 oracle).
"""
from __future__ import annotations

import functools

import pytest

import kvjax
from kvjax.attention.variants import sinks_window, sliding_window, with_attention
from kvjax.caches.layout import PageRelease
from kvjax.engine.sched.mask_release import MaskRelease, mask_release
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.engine.sched.scheduler import Scheduler
from tests.test_attention_variants import LANDMARK, PROMPT, model  # noqa: F401 (a fixture)
from tests.test_scheduler import FakeDevice, assert_no_leak, generate_alone

Z, MAX_LEN, NEW = 4, 128, 40
LANDMARK_RULE = LANDMARK.mask  # (q - k < 12) | (k % 8 == 0): pages 0, 2, 4 ... keep a key
MONOTONE = {
    "window": sliding_window(12),
    "sinks_window": sinks_window(4, 8),
    "landmark": kvjax.AttentionVariant("landmark-monotone", mask=LANDMARK_RULE,
                                       monotone=True),
    "dilated": kvjax.AttentionVariant(
        "dilated-monotone", mask=lambda q, k: (q - k < 3) | ((q - k < 24) & (k % 3 == 0)),
        monotone=True),
}
PER_LAYER = lambda cfg, layer: MONOTONE["window"] if layer % 2 else MONOTONE["sinks_window"]


@functools.lru_cache(maxsize=None)
def _brute_dead(masks: tuple, start: int) -> frozenset:
  """Written pages no query at or after start sees in any layer."""
  dead = set()
  for page in range(start // Z):
    keys = range(page * Z, (page + 1) * Z)
    if not any(bool(mask(q, k)) and k <= q for mask in masks for q in range(start, MAX_LEN)
               for k in keys):
      dead.add(page)
  return frozenset(dead)


@pytest.mark.parametrize("name", sorted(MONOTONE))
def test_dead_pages_equal_the_brute_force_at_every_start(name):
  mask = MONOTONE[name].mask
  release = MaskRelease(Z, PageRelease(Z), (mask,), MAX_LEN)
  for start in range(MAX_LEN):
    assert set(release.dead_pages(start)) == _brute_dead((mask,), start), start


@pytest.mark.parametrize("name", sorted(MONOTONE))
def test_max_pages_held_is_the_most_any_start_holds(name):
  """The bound that sizes the pool and admits requests: the most live pages a row of up to
  n positions holds from any start s, by the brute force at every s."""
  mask = MONOTONE[name].mask
  release = MaskRelease(Z, PageRelease(Z), (mask,), MAX_LEN)
  for num_tokens, n in ((40, 1), (40, 8), (MAX_LEN, 16)):
    last = num_tokens - 2  # the last position fed
    want = max(min(s + n - 1, last) // Z + 1 - len(_brute_dead((mask,), s))
               for s in range(last + 1))
    assert release.max_pages_held(num_tokens, n) == want, (num_tokens, n)
    assert want < -(-last // Z)  # below holding every page


def _masks_of(attention, model) -> tuple:
  """The distinct masks mask_release takes from `attention` on `model` (() if none)."""
  release = mask_release(PageRelease(Z), with_attention(model, attention).config, draft=None)
  return release.masks if isinstance(release, MaskRelease) else ()


def _check_held(sched, masks, released):
  """Every running request holds exactly the pages the brute force leaves live."""
  sched.check_invariants()
  for req in sched.running:
    dead = _brute_dead(masks, req.num_computed_tokens) if masks else frozenset()
    assert {i for i, p in enumerate(req.pages) if p == NULL_PAGE} == dead, \
        (req.request_id, req.num_computed_tokens)
    released.append(len(dead))


def _watch(sched, masks):
  """Wrap sched.schedule: each plan checked by _check_held -> the released counts."""
  released, schedule = [], sched.schedule

  def schedule_and_check(*args, **kwargs):
    plan = schedule(*args, **kwargs)
    _check_held(sched, masks, released)
    return plan

  sched.schedule = schedule_and_check
  return released


# name -> (attention, the window the fake device reads back: no released page inside it;
# dilated: a page ending at or after s - 21 holds 3 keys > s - 24, one a multiple of 3)
HOST_CASES = {**{name: (v, w) for (name, v), w in zip(sorted(MONOTONE.items()),
                                                       (21, 12, 8, 12))},
              "per_layer": (PER_LAYER, 12)}


@pytest.mark.parametrize("num_draft", [0, 2])
@pytest.mark.parametrize("name", sorted(HOST_CASES))
def test_scheduler_holds_what_the_brute_force_leaves_live(model, name, num_draft):
  """Host only (tests/test_scheduler.py's fake device, token ids as KV): chunks, drafts,
  a prefix hit; every page back at the end."""
  attention, read_back = HOST_CASES[name]
  masks = _masks_of(attention, model)
  release = MaskRelease(Z, PageRelease(Z), masks, MAX_LEN)
  sched = Scheduler(num_pages=40, page_size=Z, max_num_seqs=2, max_num_batched_tokens=8,
                    max_model_len=MAX_LEN, sliding_window=read_back, page_release=release,
                    num_lookahead_slots=num_draft)
  released = _watch(sched, masks)
  prompts = {"a": list(range(2, 40)), "b": list(range(2, 30)) + [7, 7], "c": [3] * 9}
  for rid, prompt in prompts.items():
    sched.add_request(rid, prompt, 60)
  assert FakeDevice(sched).run() == {rid: generate_alone(p, 60) for rid, p in prompts.items()}
  assert sched.prefix_cache.hit_tokens > 0
  assert max(released) > 0
  assert_no_leak(sched)


def test_release_needs_a_monotone_mask_in_every_cache_layer(model):
  window, sinks = MONOTONE["window"], MONOTONE["sinks_window"]
  assert _masks_of(PER_LAYER, model) == (sinks.mask, window.mask)
  assert _masks_of(window, model) == (window.mask,)
  assert _masks_of(LANDMARK, model) == ()  # a mask, but not declared monotone
  assert _masks_of(lambda cfg, layer: window if layer else None, model) == ()
  assert _masks_of(kvjax.AttentionVariant("score-only", score=lambda s, q, k, h: s,
                                          monotone=True), model) == ()
  cfg = with_attention(model, window).config
  # a draft model without a variant reads every page: nothing released
  assert mask_release(PageRelease(Z), cfg, draft=model.config) == PageRelease(Z)
  assert _masks_of(window, model) == (window.mask,)


def _run_engine(model, attention, masks):
  """Greedy NEW tokens for PROMPT, then PROMPT again (a prefix hit) beside a shorter one,
  through an engine checked each step -> the released counts."""
  engine = kvjax.Engine(model, attention=attention, page_size=Z, max_num_seqs=2,
                        max_num_batched_tokens=16, max_model_len=MAX_LEN)
  released = _watch(engine.scheduler, masks)
  prompts = [PROMPT, PROMPT[:29]]
  tokens = engine.generate(prompts[:1], NEW).tokens + engine.generate(prompts, NEW).tokens
  assert engine.stats().prefix_hit_tokens >= len(PROMPT) - Z
  assert_no_leak(engine.scheduler)
  want = kvjax.generate(model, prompts, NEW, cache="none", attention=attention).tokens
  assert tokens == want[:1] + want
  return released


def test_engine_releases_the_landmark_holes_and_keeps_its_tokens(model):
  """Pages 1, 3, 5 ... (no landmark key, Z = 4) die behind the window; 0, 2, 4 ... stay."""
  variant = MONOTONE["landmark"]
  assert max(_run_engine(model, variant, (variant.mask,))) > 1


def test_engine_with_the_landmark_not_declared_monotone_releases_nothing(model):
  assert max(_run_engine(model, LANDMARK, None)) == 0
