"""KV layer groups: the layers that attend alike share one page pool and block table.

A model whose layers attend over different windows (Gemma 3: five sliding layers of
window 512, then one global layer) needs, per request, only the pages inside the window
in its sliding layers but every page in its global ones.  With one pool for every layer,
a page is freed only when no layer reads it, so the sliding layers hold as much as the
global ones.  One pool per group of layers with the same window and attention variant
lets a group free what its own layers no longer read (vLLM's hybrid KV-cache manager
keeps one block pool per KVCacheGroupSpec the same way).

`layer_groups(cfg)` is the one place the groups are declared: cfg's cache layers grouped
by (window, variant), in order of their first layer (with MTP drafting, the MTP modules'
layers too, each in its window's group: the model's `sliding_window`, none for Gemma 3);
a model whose layers all attend alike has one group (and the engine keeps its plain
one-pool cache).  `GroupedKVCache` holds one `PagedKVCache` per group, of that group's
layers and its own number of pages; a step's StepBatch carries one block table per group
(`group_tables`), and layer l reads and writes its group's pool, at its index within the
group, through its group's table.  Page 0 of every pool is the null page (kvjax/caches/paged.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from flax import struct

from kvjax.caches.layout import KVLayout, PoolSizes, allocate, get_layout, store_name
from kvjax.caches.paged import PagedKVCache, clear_cache_pages
from kvjax.model.config import ModelConfig
from kvjax.runtime.step_batch import StepBatch

__all__ = ["LayerGroup", "layer_groups", "GroupedKVCache", "check_grouped_layout",
           "create_grouped_cache"]


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Cache layers (increasing indices) that attend over the same `window` (None: every
  key) with the same attention `variant` (None: plain), so they read the same pages."""

  window: Optional[int]
  variant: Any
  layers: tuple


def layer_groups(cfg: ModelConfig, with_mtp: bool = False) -> tuple[LayerGroup, ...]:
  """cfg's cache layers (the trunk's, and with_mtp the MTP modules' after them) grouped by
  (window, variant), in order of first layer."""
  layers_of: dict = {}
  for layer in range(cfg.cache_layers(with_mtp)):
    key = (cfg.window_of_layer(layer), cfg.variant_of_layer(layer))
    layers_of.setdefault(key, []).append(layer)
  return tuple(LayerGroup(window, variant, tuple(layers))
               for (window, variant), layers in layers_of.items())


@struct.dataclass
class GroupedKVCache:
  """One PagedKVCache per layer group (`pools`); `places[l]` is cache layer l's (group,
  index within the group)."""

  pools: tuple
  places: tuple = struct.field(pytree_node=False)

  def attend(self, layer: int, q, k, v, batch: StepBatch, **options):
    """The layer's group pool attends through the group's block table (the contract in
    kvjax/caches/__init__.py)."""
    group, index = self.places[layer]
    pool, out = self.pools[group].attend(
        index, q, k, v, batch.replace(block_tables=batch.group_tables[group]), **options)
    return self.replace(pools=self.pools[:group] + (pool,) + self.pools[group + 1:]), out

  def keep_accepted(self, batch: StepBatch, accepted) -> "GroupedKVCache":
    """After verifying drafts: nothing to undo in any group's pages, since the host's
    lengths and each group's block table drop the rejected positions (PagedKVCache's)."""
    return self

  def cleared(self, pages: tuple, slots) -> "GroupedKVCache":
    """pages[g] (page ids) zeroed in group g's pool (kvjax/caches/paged.py
    clear_cache_pages: a failed request's)."""
    return self.replace(pools=tuple(clear_cache_pages(pool, group_pages, slots)
                                    for pool, group_pages in zip(self.pools, pages)))


def check_grouped_layout(kv_dtype, cfg: ModelConfig) -> KVLayout:
  """The layout kv_dtype names for cfg; ValueError naming kv_dtype unless its cache is
  plain float or int8 pages (the arrays a group's pool slices by layer)."""
  layout = get_layout(kv_dtype, cfg)
  if layout.cache is not PagedKVCache or cfg.is_hybrid:
    raise ValueError(f"kv_groups needs float or int8 pages of a non-hybrid model; "
                     f"kv_dtype {layout.name!r} of {cfg.name!r} is not")
  return layout


def create_grouped_cache(cfg: ModelConfig, kv_dtype, num_slots: int,
                         group_pages: Sequence[int], page_size: int,
                         dtype, with_mtp: bool = False) -> GroupedKVCache:
  """Empty pools for cfg's layer groups (with_mtp: the MTP modules' layers in theirs),
  group g of group_pages[g] pages (null page included), in kv_dtype's layout at model
  dtype `dtype`."""
  layout = check_grouped_layout(kv_dtype, cfg)
  groups = layer_groups(cfg, with_mtp)
  if len(group_pages) != len(groups):
    raise ValueError(f"group_pages has {len(group_pages)} entries for {len(groups)} layer "
                     "groups")
  store = layout.store or store_name(dtype)
  pools = []
  for group, num_pages in zip(groups, group_pages):
    specs = layout.arrays(cfg, store, PoolSizes(num_pages, page_size, num_slots))
    # Page arrays lead with the layer axis: the group's pool keeps its own layers only.
    specs = {name: dataclasses.replace(spec, shape=(len(group.layers),) + spec.shape[1:])
             for name, spec in specs.items()}
    pools.append(layout.cache(**allocate(specs), **layout.static_fields(cfg)))
  places = {layer: (g, i) for g, group in enumerate(groups)
            for i, layer in enumerate(group.layers)}
  return GroupedKVCache(tuple(pools), tuple(places[l] for l in range(len(places))))
