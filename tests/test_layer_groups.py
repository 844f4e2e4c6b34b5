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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.caches import create_paged_cache
from kvjax.caches.groups import create_grouped_cache, layer_groups
from kvjax.engine.sched.pages import NULL_PAGE
from kvjax.model.params import init_params
from kvjax.runtime.step_batch import make_step_batch
from kvjax.runtime.steps import prefill

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
