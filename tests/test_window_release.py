"""Sliding-window page release through the Engine: bounded pages, same tokens.

W = 32, G = 8.  A row of n positions starting at s holds pages (s - 31) // 8
through (s + n - 1) // 8 (kvjax/engine/sched/scheduler.py), at most ceil((W + n - 2) / G) + 1:
5 for decode rows (n = 1; within the issue's ceil(W / G) + 2 = 6) and 7 for
16-token prefill chunks.  The oracle is the static contiguous cache, which has
no pages at all.
"""
from __future__ import annotations

import functools

import jax
import pytest

import kvjax
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.model.params import init_params

W, G, BUDGET = 32, 8, 16
DECODE_BOUND = -(-(W + 1 - 2) // G) + 1  # 5
PREFILL_BOUND = -(-(W + BUDGET - 2) // G) + 1  # 7
LONG, SHORT = list(range(3, 13)), list(range(40, 110))  # 10 and 70 tokens
ENGINE = dict(page_size=G, max_num_seqs=2, max_num_batched_tokens=BUDGET, max_model_len=512)


@functools.lru_cache(maxsize=None)
def _model(layer_windows=None) -> kvjax.Model:
  """Random 2-layer 'tiny'; std 0.2 keeps greedy argmax margins >> rounding."""
  cfg = kvjax.get_preset("tiny").replace(
      name=f"window-release-{layer_windows}", eos_token_id=None,
      sliding_window=None if layer_windows else W, layer_windows=layer_windows)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


@functools.lru_cache(maxsize=None)
def _oracle() -> list:
  """Greedy 300 tokens after LONG and SHORT (prefixes serve shorter runs)."""
  return kvjax.generate(_model(), [LONG, SHORT], 300, cache="contiguous").tokens


def _record_pages(eng):
  """Wrap the scheduler: per step, (decode step?, allocator.num_used) as it runs."""
  used, schedule = [], eng.scheduler.schedule

  def schedule_and_record(*args, **kwargs):
    plan = schedule(*args, **kwargs)
    used.append((all(row.is_decode for row in plan.rows), eng.scheduler.allocator.num_used))
    eng.scheduler.allocator.check_invariants()
    return plan

  eng.scheduler.schedule = schedule_and_record
  return used


@pytest.mark.parametrize("num_scheduler_steps", [1, 16])
def test_long_generation_holds_bounded_pages_and_keeps_its_tokens(num_scheduler_steps):
  # Single decode steps write 1 position (DECODE_BOUND); a 16-step burst reserves
  # its 16 positions up front, as a 16-token prefill chunk does (PREFILL_BOUND).
  bound = DECODE_BOUND if num_scheduler_steps == 1 else PREFILL_BOUND
  model, want = _model(), _oracle()
  # 7 usable pages (max_pages_held), while LONG + 300 spans 39 pages.
  eng = kvjax.Engine(model, num_pages=8, num_scheduler_steps=num_scheduler_steps, **ENGINE)
  assert eng.scheduler.sliding_window == W
  assert eng.scheduler.pages.max_pages_held(len(LONG) + 300) == PREFILL_BOUND
  used = _record_pages(eng)
  assert eng.generate([LONG], 300).tokens == [want[0]]  # one 10-token chunk, then decodes
  assert max(n for _, n in used) == bound
  assert max(eng.steps.num_steps) == num_scheduler_steps
  used.clear()
  assert eng.generate([SHORT], 40).tokens == [want[1][:40]]  # 16-token chunks
  assert max(n for decode, n in used if not decode) <= PREFILL_BOUND
  assert max(n for decode, n in used if decode) == bound
  eng.scheduler.check_invariants()
  assert eng.scheduler.allocator.num_used == 0


def test_default_pool_holds_what_windowed_requests_can_hold():
  # Two slots of max_model_len 512: 2 x 7 pages (PREFILL_BOUND) with the window,
  # 2 x 64 (the whole 511 positions) once one layer attends to everything.
  assert kvjax.Engine(_model(), **ENGINE).scheduler.allocator.num_pages == 1 + 2 * PREFILL_BOUND
  full = kvjax.Engine(_model((W, None)), **ENGINE)
  assert full.scheduler.allocator.num_pages == 1 + 2 * -(-511 // G)


def test_pallas_kernel_skips_the_released_pages():
  # The kernel starts each query block at page (first position - W + 1) // G,
  # never at a released (null) entry.  7 usable pages < the 9 that 70 positions span.
  eng = kvjax.Engine(_model(), num_pages=8, backend="pallas_interpret", **ENGINE)
  assert eng.generate([LONG], 60).tokens == [_oracle()[0][:60]]


def test_a_full_attention_layer_releases_nothing():
  model = _model((W, None))
  assert model.config.kv_window is None and _model((None, W)).config.kv_window is None
  eng = kvjax.Engine(model, num_scheduler_steps=1, **ENGINE)  # a page count per token
  assert eng.scheduler.sliding_window is None
  used = _record_pages(eng)
  eng.generate([LONG], 48)
  assert [n for _, n in used] == [-(-(len(LONG) + i) // G) for i in range(48)]


def test_mtp_layers_and_draft_models_count_their_windows():
  base = kvjax.get_preset("tiny")
  mtp = base.replace(layer_windows=(W, W), mtp_num_hidden_layers=1)
  assert mtp.kv_window is None  # MTP blocks use the global window: None
  assert mtp.replace(sliding_window=2 * W).kv_window == 2 * W
  target, draft = _model(), kvjax.load_checkpoint("tiny", seed=1)
  eng = kvjax.Engine(target, speculative=draft, **ENGINE)
  assert eng.scheduler.sliding_window is None  # the draft model attends to everything
  windowed = kvjax.Model(draft.config.replace(sliding_window=W // 2), draft.params)
  assert kvjax.Engine(target, speculative=windowed, **ENGINE).scheduler.sliding_window == W


def test_abort_and_preemption_free_every_page_once():
  # 7 usable pages: each request fits alone (peak 7), two decoding ones (5 + 5) do not.
  eng = kvjax.Engine(_model(), num_pages=8, prefix_match="token", **ENGINE)
  ids = [eng.add_request(LONG, 120), eng.add_request(SHORT, 60),
         eng.add_request(SHORT[5:], 60)]
  aborted, finals = False, {}
  while eng.has_unfinished:
    victim = eng.scheduler.requests.get(ids[2])
    if victim is not None and NULL_PAGE in victim.pages:  # running, pages released
      assert eng.abort(ids[2])
      aborted = True
    finals.update({out.request_id: out for out in eng.step() if out.finished})
    eng.scheduler.check_invariants()
  assert aborted and eng.scheduler.num_preemptions > 0
  want = _oracle()
  assert [finals[rid].output_ids for rid in ids[:2]] == [want[0][:120], want[1][:60]]
  assert finals[ids[2]].finish_reason == "abort"
  assert eng.scheduler.allocator.num_used == 0
