"""Attention sinks + window as a kv_dtype: variant_layout (kvjax/caches/paged.py) names the
sinks_window attention variant over float pages ("streaming" is StreamingLLM's 4 + 1020).

Oracles: a float64 numpy brute force of sinks + window attention (its mask written
from the definition, key j visible iff j <= p and (j < S or j > p - W)); the
contiguous twin, which has no pages to release; exact page and byte arithmetic.
4 sinks, a 16-token window, Z = 8 tokens per page: a row of n positions starting
at s holds the sink page plus pages (s - 15) // 8 .. (s + n - 1) // 8.
"""
from __future__ import annotations

import functools
import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attention.backends import get_backend
from kvjax.attention.variants import sinks_window
from kvjax.caches.layout import register
from kvjax.caches.paged import PagedKVCache, variant_layout
from kvjax.cli.memory import allocated_pool
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.model.params import init_params
from kvjax.parallel import ledger
from kvjax.runtime.step_batch import make_step_batch

SINKS, WINDOW, Z, BUDGET = 4, 16, 8, 16
LAYOUT = register(variant_layout(sinks_window(SINKS, WINDOW), store="fp32"))  # "sinks4-window16"
# One sink page + ceil((W + n - 2) / Z) + 1 window pages: n = 1 decodes, n = 16 chunks.
DECODE_BOUND = 1 + -(-(WINDOW + 1 - 2) // Z) + 1  # 4
PREFILL_BOUND = 1 + -(-(WINDOW + BUDGET - 2) // Z) + 1  # 6
LONG, SHORT = list(range(3, 40)), list(range(50, 60))  # 37 and 10 tokens
ENGINE = dict(page_size=Z, max_num_seqs=2, max_num_batched_tokens=BUDGET, max_model_len=256,
              kv_dtype=LAYOUT.name)


def _brute_force(q, k, v, context, sm_scale):
  """q [T, N, H] at positions context - T .. context - 1 over k, v [S, K, H], float64:
  key j is visible to the query at p iff j <= p and (j < SINKS or j > p - WINDOW)."""
  t, n, _ = q.shape
  group = n // k.shape[1]
  out = np.zeros((t, n, v.shape[2]))
  for i in range(t):
    p = context - t + i
    keys = [j for j in range(p + 1) if j < SINKS or j > p - WINDOW]
    for head in range(n):
      scores = np.array([q[i, head] @ k[j, head // group] for j in keys]) * sm_scale
      weights = np.exp(scores - scores.max())
      out[i, head] = (weights / weights.sum()) @ v[keys, head // group]
  return out


def test_attend_matches_float64_brute_force_over_released_pages():
  """Three steps of one row through the paged cache: a 21-token prefill, a 17-token chunk
  with the pages between sink and window swapped for the null page (as the scheduler
  releases them), then a decode; each step's output equals the brute force."""
  num_kv, n, h = 2, 4, 8
  cache = PagedKVCache.create(1, num_kv, 12, Z, h, jnp.float32)
  tables = np.array([[3, 7, 1, 9, 4, 11]], np.int32)  # shuffled physical pages
  rng = np.random.default_rng(0)
  k_all, v_all = rng.normal(size=(2, 39, num_kv, h))
  kwargs = dict(sm_scale=h ** -0.5, backend=get_backend("reference"),
                variant=LAYOUT.variant)
  start = 0
  for t in (21, 17, 1):
    q = rng.normal(size=(t, n, h))
    live = tables.copy()
    live[0, 1:max(1, (start - WINDOW + 1) // Z)] = NULL_PAGE  # dead pages after the sink
    batch = make_step_batch(np.zeros((1, t)), [start], [t], live, [0])
    cache, out = cache.attend(0, jnp.asarray(q[None], jnp.float32),
                              jnp.asarray(k_all[None, start:start + t], jnp.float32),
                              jnp.asarray(v_all[None, start:start + t], jnp.float32),
                              batch, **kwargs)
    want = _brute_force(q, k_all, v_all, start + t, h ** -0.5)
    np.testing.assert_allclose(np.asarray(out[0]), want, atol=2e-5)
    start += t
  assert start - WINDOW + 1 >= 3 * Z  # the last step really read through null pages


@functools.lru_cache(maxsize=None)
def _model() -> kvjax.Model:
  """Random 2-layer 'tiny'; std 0.2 keeps greedy argmax margins >> rounding."""
  cfg = kvjax.get_preset("tiny").replace(name="streaming-test", eos_token_id=None)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


@functools.lru_cache(maxsize=None)
def _oracle() -> list:
  """Greedy 120 tokens after LONG and SHORT from the contiguous twin (nothing released)."""
  return kvjax.generate(_model(), [LONG, SHORT], 120, cache="contiguous",
                        kv_dtype=LAYOUT).tokens


def test_generate_matches_the_contiguous_twin_and_differs_from_full_attention():
  want = _oracle()
  assert kvjax.generate(_model(), [LONG, SHORT], 120, page_size=Z, kv_dtype=LAYOUT).tokens \
      == want
  assert kvjax.generate(_model(), [LONG, SHORT], 120, page_size=Z).tokens != want


def _record_pages(eng):
  """Wrap the scheduler: allocator.num_used after each plan, invariants checked."""
  used, schedule = [], eng.scheduler.schedule

  def schedule_and_record(*args, **kwargs):
    plan = schedule(*args, **kwargs)
    used.append(eng.scheduler.allocator.num_used)
    eng.scheduler.check_invariants()
    return plan

  eng.scheduler.schedule = schedule_and_record
  return used


@pytest.mark.parametrize("num_scheduler_steps", [1, 16])
def test_engine_holds_bounded_pages_keeps_sink_pages_and_its_tokens(num_scheduler_steps):
  want = _oracle()
  # LONG + 120 spans 20 pages; the pool has 2 x PREFILL_BOUND usable ones.
  eng = kvjax.Engine(_model(), num_pages=1 + 2 * PREFILL_BOUND,
                     num_scheduler_steps=num_scheduler_steps, **ENGINE)
  assert eng.scheduler.pages.max_pages_held(len(LONG) + 120) == PREFILL_BOUND == 6
  used = _record_pages(eng)
  assert eng.generate([LONG], 120).tokens == [want[0]]
  assert max(used) == (DECODE_BOUND if num_scheduler_steps == 1 else PREFILL_BOUND)
  assert eng.generate([LONG, SHORT], 120).tokens == want  # LONG again: a prefix hit
  # The tight pool evicted the released blocks first; the hit stops at the first missing one.
  assert eng.scheduler.prefix_cache.hit_tokens >= Z
  eng.scheduler.check_invariants()
  assert eng.scheduler.allocator.num_used == 0


def test_release_keeps_the_sink_page_through_a_prefix_hit():
  eng = kvjax.Engine(_model(), **ENGINE)
  eng.generate([LONG], 60)
  req_id = eng.add_request(LONG + [7] * 20, 8)
  eng.step()  # admitted with LONG's 4 full blocks as a hit, then a 16-token chunk
  assert eng.scheduler.prefix_cache.hit_tokens == 32
  req = eng.scheduler.requests[req_id]
  end = (req.num_computed_tokens - WINDOW + 1) // Z  # 48 computed: pages 1..3 are dead
  assert end == 4 and req.pages[0] != NULL_PAGE
  assert req.pages[1:end] == [NULL_PAGE] * 3 and NULL_PAGE not in req.pages[end:]
  while eng.has_unfinished:
    eng.step()
  assert eng.scheduler.allocator.num_used == 0


def test_ledger_and_kvjax_memory_count_the_allocated_pool(capsys):
  cfg = _model().config
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
  eng = kvjax.Engine(_model(), **ENGINE)
  pool = eng.state.cache
  assert isinstance(pool, PagedKVCache)
  pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pool))
  assert pool_bytes == ledger.kv_bytes_per_token(cfg, LAYOUT.name) * eng.config.num_pages * Z
  assert ledger.kv_bytes_per_token(cfg, LAYOUT.name) == per_token
  assert allocated_pool(cfg, LAYOUT.name, "fp32")["kv_bytes_per_token"] == per_token
  # 200 tokens in the ledger's 16-token pages: pages 1..10 are released, 40 tokens held.
  assert ledger.kv_bytes_per_request(cfg, 200, LAYOUT.name) == 40 * per_token
  from kvjax.cli import main as cli
  assert cli.main(["memory", "--preset", "tiny", "--context", "200", "--kv-dtype",
                   LAYOUT.name, "--json"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["kv_bytes_per_request"] == 40 * per_token
  assert printed["allocated_pool"]["cache"] == "PagedKVCache"


def test_streaming_is_an_alias_of_the_sinks_window_variant():
  eng = kvjax.Engine(_model(), kv_dtype="streaming", max_model_len=64)
  assert eng.model.config.attention_variant == sinks_window(4, 1020)
  assert isinstance(eng.state.cache, PagedKVCache)


def test_refusals_name_the_value():
  windowed = kvjax.Model(_model().config.replace(sliding_window=8), _model().params)
  with pytest.raises(ValueError, match="needs a model without sliding windows"):
    kvjax.Engine(windowed, kv_dtype=LAYOUT)
  with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
    variant_layout(sinks_window(4, 0))


def test_server_serves_it():
  from kvjax.server import serve_in_thread
  model = _model()
  prompt = LONG
  want = kvjax.generate(model, [prompt], 40, cache="contiguous", kv_dtype=LAYOUT).tokens[0]
  config = kvjax.EngineConfig(**ENGINE)
  with serve_in_thread(model, config, served_model_name="streaming") as handle:
    body = {"model": "streaming", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    got = httpx.post(handle.url + "/completions", json=body, timeout=120).json()
  assert got["choices"][0]["token_ids"] == want


def test_a_draft_model_runs_the_variant_too_and_middle_pages_still_go():
  """The draft's cache reads the same pages, so it attends under the alias's variant too
  and the middle pages are released as without it.  The draft here is the target itself:
  under the same rule its greedy drafts are the target's, so every one is accepted; a
  draft attending with full attention would read the released pages (null) and miss."""
  want = _oracle()
  eng = kvjax.Engine(_model(), speculative=_model(), num_draft=3, **ENGINE)
  assert eng.draft_model.config.attention_variant == LAYOUT.variant
  used = _record_pages(eng)
  result = eng.generate([LONG], 120)
  assert result.tokens == [want[0]]
  assert max(used) <= PREFILL_BOUND + 1  # the sink page, the window and the draft slots
  assert result.stats["num_verify_steps"] > 20 and result.stats["acceptance_rate"] == 1.0
  eng.scheduler.check_invariants()
  assert eng.scheduler.allocator.num_used == 0
