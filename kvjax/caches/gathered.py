"""`GatheredKVCache`: the K/V of a device loop's rows, gathered out of their pages once.

The jnp reference backend reads pages by gathering every row's pages into a
dense [K, B, S, H] copy, in every layer of every step; at batch 32 on a CPU
that gather is most of a decode step.  A device loop of decode steps over the
same rows (a multi-step burst, kvjax/runtime/serve_steps.py; kvjax.generate's decode
loop) would gather the same pages each step for the few positions the steps
before it wrote.  `decode_loop_cache` instead gathers every layer once before
the loop; each step writes its K/V into the dense copy and attends it through
the backend's `gathered_attention` (the same core its paged attention runs
after its gather, so every step sees the keys and values the pages would give
it), and the loop's `settle` writes the positions the loop computed back to
the pages.  Only float pages (`PagedKVCache.gathers_rows`) of a backend that
has `gathered_attention` loop this way, and only while the copy stays under
`MAX_GATHERED_BYTES`; kernels that read pages in place, int8 / int4 pages, MLA
latents and hybrid state read pages every step.  A batch-invariant backend's copy
covers whole blocks of pages, walked in the blocks its steps read pages in.
Shapes: docs/DIMENSIONS.md.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.attention.backends import get_backend
from kvjax.attention.blocked import block_pages
from kvjax.attention.paged import padded_tables
from kvjax.caches.paged import PagedKVCache, physical_pages
from kvjax.runtime.step_batch import StepBatch

__all__ = ["GatheredKVCache", "decode_loop_cache", "MAX_GATHERED_BYTES"]

# Both dense copies together (every layer, every row's table); past it a loop reads pages.
MAX_GATHERED_BYTES = 512 << 20


@struct.dataclass
class GatheredKVCache:
  pages: PagedKVCache  # the pool, unchanged until the loop settles
  # Per layer (a tuple, so a step's attention reads its layer's copy without slicing it
  # out of a stacked array, which would copy it): row b's positions 0..S-1, S = W * Z.
  # The pool's first L layers: a loop that never drafts leaves the MTP modules' layers
  # (after the trunk's) in their pages, and attending one raises IndexError.
  k: tuple  # L x [K, B, H, S] (keys transposed: the layout `gathered_attention` reads)
  v: tuple  # L x [K, B, S, H]

  @classmethod
  def gather(cls, pages: PagedKVCache, block_tables: jax.Array,
             num_layers: int) -> "GatheredKVCache":
    """The first num_layers layers of the rows with block_tables [B, W], kv-head-major."""
    _, num_kv, _, z, h = pages.k_pages.shape
    b, w = block_tables.shape
    dense = lambda x: tuple(x[layer][:, block_tables].reshape(num_kv, b, w * z, h)
                            for layer in range(num_layers))
    keys_t = tuple(jnp.swapaxes(k, 2, 3) for k in dense(pages.k_pages))
    return cls(pages=pages, k=keys_t, v=dense(pages.v_pages))

  def attend(self, layer: int, q, k, v, batch: StepBatch, *, sm_scale: float, backend,
             **options):
    """Write k, v [B, T, K, H] at their positions, then q [B, T, N, H] attends the copy;
    batch's rows are the gathered rows (padding columns write nothing); `options` (a
    layer kind's extras, e.g. sinks; the layer's attention variant) go to the backend's
    attention."""
    rows = jnp.arange(q.shape[0])[:, None]  # [B, 1]
    positions = jnp.where(batch.valid, batch.positions, self.num_positions)  # S: dropped
    # Advanced indices split by a slice put their [B, T] first: the value is new [B, T, K, H].
    keys = self.k[layer].at[:, rows, :, positions].set(k.astype(self.k[layer].dtype),
                                                      mode="drop")
    values = self.v[layer].at[:, rows, positions].set(
        v.astype(self.v[layer].dtype).transpose(2, 0, 1, 3), mode="drop")
    cache = self.replace(k=_with(self.k, layer, keys), v=_with(self.v, layer, values))
    out = backend.gathered_attention(q, keys.astype(q.dtype), values, batch,
                                     page_size=self.pages.page_size, sm_scale=sm_scale,
                                     **options)
    return cache, out

  @property
  def num_positions(self) -> int:
    """S: the positions each gathered row holds."""
    return self.v[0].shape[2]

  def keep_accepted(self, batch: StepBatch, accepted: jax.Array) -> "GatheredKVCache":
    return self  # like pages: the lengths drop rejected positions

  def settle(self, block_tables: jax.Array, first: jax.Array, end: jax.Array,
             span: int) -> PagedKVCache:
    """The pool with each row's positions [first, end) (first, end [B]; end - first <=
    span) written back from the copy: what the loop computed."""
    positions = first[:, None] + jnp.arange(span, dtype=jnp.int32)[None]  # [B, span]
    z = self.pages.page_size
    page = physical_pages(block_tables, positions // z)
    page = jnp.where(positions < end[:, None], page, self.pages.num_pages)  # dropped
    rows = jnp.arange(first.shape[0])[:, None]
    column = jnp.minimum(positions, self.num_positions - 1)
    used = len(self.k)
    back = lambda pool, rows_kv: pool.at[:used, :, page, positions % z].set(
        jnp.stack(rows_kv), mode="drop")  # [L, K, B, span, H]
    keys = [k_t[:, rows, :, column].transpose(2, 0, 1, 3) for k_t in self.k]  # [K, B, span, H]
    values = [v[:, rows, column] for v in self.v]  # [K, B, span, H]
    return self.pages.replace(k_pages=back(self.pages.k_pages, keys),
                              v_pages=back(self.pages.v_pages, values))


def _with(layers: tuple, layer: int, value) -> tuple:
  return layers[:layer] + (value,) + layers[layer + 1:]


def decode_loop_cache(cache, block_tables: jax.Array, backend, num_layers: Optional[int] = None
                      ) -> tuple[object, Callable[[object, jax.Array, jax.Array, int], object]]:
  """(the cache a decode loop over these rows carries, settle(loop cache, first [B], end
  [B], span) -> the cache after it): a GatheredKVCache of the first num_layers layers
  (None: all; fewer when the loop runs no MTP module) and its write-back where the cache
  and backend allow (module doc), else the cache itself and no-op."""
  backend = get_backend(backend)
  gathers = getattr(cache, "gathers_rows", False) and backend.gathered_attention is not None
  if gathers:
    all_layers, num_kv, _, z, h = cache.k_pages.shape
    if backend.batch_invariant:  # its attention walks the copy in whole blocks of pages
      block_tables, _ = padded_tables(block_tables, block_pages(z))
    num_layers = num_layers or all_layers
    copy_bytes = 2 * num_layers * num_kv * block_tables.size * z * h * cache.k_pages.dtype.itemsize
    gathers = copy_bytes <= MAX_GATHERED_BYTES
  if not gathers:
    return cache, lambda loop_cache, first, end, span: loop_cache
  return (GatheredKVCache.gather(cache, block_tables, num_layers),
          lambda loop_cache, first, end, span: loop_cache.settle(block_tables, first, end, span))
