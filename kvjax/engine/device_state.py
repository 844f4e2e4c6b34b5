"""The Engine's device state: built once from its config, and the page copies and clears
the host applies to it, each padded to one shape so that any number of them runs one
compiled program.

What the Engine holds as `engine.state` (kvjax/runtime/serve_steps.py EngineState): the
K/V pages (one pool, or one per KV layer group: kvjax/caches/groups.py), a draft model's
pages, and each slot's pending drafts.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.caches import PagedKVCache, create_paged_cache
from kvjax.caches.groups import create_grouped_cache
from kvjax.engine.config import EngineConfig
from kvjax.runtime.serve_steps import EngineState, clear_pages, copy_pages

__all__ = ["initial_state", "apply_page_copies", "clear_request_pages"]


def initial_state(model, config: EngineConfig, pool_sizes: Sequence[int],
                  num_slot_drafts: int) -> EngineState:
  """Zeroed pages for max_num_seqs + 1 slots (the last: padding rows' scratch slot).

  pool_sizes: pages per KV layer group (one entry: the one pool); num_slot_drafts: the
  drafts a slot carries between steps (0 for n-gram engines, whose drafts ride in the
  batch)."""
  cfg = model.config
  slots = config.max_num_seqs + 1
  if config.layer_groups(cfg):
    cache = create_grouped_cache(cfg, config.kv_dtype, slots, list(pool_sizes),
                                 config.page_size, model.dtype,
                                 with_mtp=config.speculative == "mtp")
  else:
    cache = create_paged_cache(
        cfg, config.kv_dtype, slots, config.num_pages, config.page_size, model.dtype,
        with_mtp=config.speculative == "mtp", mesh=config.backend.mesh,
        num_snapshots=config.prefix_snapshots,
        num_verify_states=config.drafts_per_step + 1 if config.drafts_per_step else 0)
  draft_cache = None
  if config.draft_model is not None:
    d = config.draft_model.config
    draft_cache = PagedKVCache.create(d.num_layers, d.num_kv_heads, config.num_pages,
                                      config.page_size, d.head_dim, config.draft_model.dtype)
  k = num_slot_drafts
  return EngineState(cache=cache, drafts=jnp.zeros((slots, k), jnp.int32),
                     draft_probs=jnp.zeros((slots, k, cfg.vocab_size), jnp.float32),
                     draft_cache=draft_cache)


def apply_page_copies(state: EngineState, copies, max_num_seqs: int) -> EngineState:
  """Token-mode prefix hits' page copies (kvjax/engine/requests.py PageCopy); none:
  the null page onto itself."""
  # At most one copy per admitted row: pad to max_num_seqs, one shape.
  src, dst = (np.zeros(max_num_seqs, np.int32) for _ in range(2))
  src[:len(copies)] = [cp.src for cp in copies]
  dst[:len(copies)] = [cp.dst for cp in copies]
  return copy_pages(state, src, dst)


def clear_request_pages(state: EngineState, pages: tuple, slot: int,
                        max_pages_per_seq: int) -> EngineState:
  """Zero a failed request's own pages (a list per KV layer group), the null page and its
  slot."""
  # One shape for every failure: the widest block table plus the null page.
  padded = tuple(np.zeros(max_pages_per_seq + 1, np.int32) for _ in pages)
  for padded_pages, group_pages in zip(padded, pages):
    padded_pages[:len(group_pages)] = group_pages
  return clear_pages(state, padded, np.array([slot], np.int32))
