"""Ragged paged attention: decode, speculative verify and chunked prefill in one call.

Two layers here: the Pallas kernel (`_rpa_kernel`) and the jitted wrapper that
validates, lays out and merges (`ragged_paged_attention`); beside it,
paged_attention_reference.py holds the input contract both check and the pure-jnp
oracle (`ragged_paged_attention_reference`), with the same shapes.

Semantics.  Query token i of sequence s (of q_len_s tokens) sits at position
p = kv_lens[s] - q_len_s + i and sees key j iff j <= p and mask_fn(p, j) where an
attention variant gives one (a sliding window is such a variant: j > p - W, with
kv_range_fn p -> (p - W + 1, p + 1) so the walk skips the pages behind it).  Scores are
sm_scale * q.k, then soft_cap * tanh(score / soft_cap), then score_fn(score, p, j,
query head n) where given; int8 K/V are dequantized as value * scale (per token,
per kv head).  Tokens at or past cu_q_lens[-1] are padding and come back as zeros;
sequences with q_len 0 (empty slots) cost nothing.  Preconditions the wrapper cannot check on
traced values: cu_q_lens is non-decreasing from 0, q_len_s <= kv_lens[s] <=
pages_per_seq * page_size, and the first cdiv(kv_lens[s], page_size) entries of
block_tables[s] are valid page ids (others may hold anything, -1 included:
they are clamped and never contribute).

Kernel design (dimension legend, as kvjax's docs/DIMENSIONS.md: T query tokens
(all rows flattened), B sequences, N q heads, K kv heads, Gq q heads per kv
head, H head_dim, P pages, Z page size, S key positions).
  * Work tile = (query tile, kv head, kv split).  A query tile holds `block_q`
    consecutive tokens of ONE sequence times all Gq query heads of one kv head,
    so each K/V page is read once per GQA group ([block_q * Gq, H] rows).  Tiles
    start at sequence starts, so a sequence's tiling depends on its own q_len
    only; the static tile count min(T, cdiv(T, block_q) + B) covers any ragged
    mix and surplus tiles exit at once.
  * Split-K at fixed absolute kv chunks of `pages_per_split` pages: the split of
    a sequence never depends on the other sequences or on the batch size (batch
    invariance).  Partials (unnormalized f32 accumulator, running max, running
    sum) are merged by log-sum-exp in the wrapper.
  * Each program loops only over the pages that intersect [first key any of
    its rows can see, last row's position] within its chunk: causal limits skip
    whole pages; the mask handles the ragged edges.  A variant's kv_range_fn
    (a window's) narrows that range the same way; its mask_fn is
    evaluated per step (positions only, before any load), and a step it hides
    from every row of the tile reads no page (lax.cond).
  * Pages are gathered inside the kernel through the block table (vector page
    index into the per-kv-head page pool), `pages_per_block` pages per step.

Hopper path decision: Pallas-Triton, decided by trying both on the H200 (jax
0.11.2, triton 3.6.0; experiments/run_kernel_device.sh, results/kernel_bench*.json).
  * Pallas-Triton still lowers and runs under jax 0.11.2 (the run log shows no
    deprecation warning for it under default filters; jax's own
    ops.gpu.paged_attention module warns it is deprecated).  This kernel,
    bf16 decode at 32 q / 8 kv heads, head_dim 128, page 16, achieved
    3.05 TB/s at batch 64 x 8k context and 3.28 TB/s at 64 x 32k (64% / 68%
    of 4.8 TB/s), 2.8 TB/s at 8 x 32k; 1.37-1.54x jax's paged_attention at
    batch 64, ~3x an XLA gather.  Small batches (B <= 8 at <= 8k) take
    0.05-0.2 ms, where launch and dispatch dominate every backend.
  * Mosaic GPU probe (pallas_kernels/mosaic_decode.py: TMA page
    gathers into a 2-4 deep SMEM ring, wgmma, q padded to 64 rows, decode only,
    no split-K/mask/window/int8): 3.34 TB/s at 64 x 8k, 3.52 TB/s at 64 x 32k
    (+7-9% over Triton), but 1.7 TB/s at 8 x 32k (no split-K) where Triton
    does 2.8.  Its interpret mode (InterpretGPUParams) cannot run a wgmma with
    a transposed operand or layout_cast, so CI could only test a variant with
    the matmuls swapped for jnp dots.
  Triton keeps the whole contract (ragged q, window page skipping, int8, soft
  cap, split-K) under one kernel that the HLO interpreter runs exactly in CI;
  a Mosaic GPU decode path for large batches is the next step (~8%).
  Static tiling (64 keys per step, 1024-token splits, 4 warps, 3 stages) is the
  best of a 12-point sweep at batch 64 x 8k (ties within 0.1% with 4096-token
  splits, which starve batch 1 of parallelism).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention_reference import check_inputs, segment_of
from pallas_kernels.position_rules import TileRules, check_rules, lift

__all__ = ["ragged_paged_attention", "default_block_sizes"]

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MIN_ROWS = 16  # Triton's tl.dot needs M >= 16.
_MIN_KEYS = 16  # ... and K >= 16.
_FAR = 1 << 30  # past any key position: a column outside the tile bounds nothing


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def default_block_sizes(page_size: int, head_dim: int, group: int):
  """Static tiling for a (page_size, head_dim, q heads per kv head) problem.

  Returns (block_q, pages_per_block, pages_per_split).  Depends on static
  shapes only, never on the batch, so results are batch invariant.
  """
  del head_dim  # 64 keys per step was best on the H200 for head_dim 128 (module doc).
  group_p = _next_pow2(group)
  block_q = max(1, _MIN_ROWS // group_p)
  pages_per_block = max(1, 64 // page_size)
  pages_per_split = max(pages_per_block, 1024 // page_size)
  pages_per_split = -(-pages_per_split // pages_per_block) * pages_per_block
  return block_q, pages_per_block, pages_per_split


def _rpa_kernel(
    meta_ref,  # [4] int32: seq row in block table, q start, q rows, pos of row 0
    block_tables_ref,  # [B + 1, pages_per_seq + pages_per_block] int32
    q_ref,  # [T + bq, group_p, H]  (this kv head)
    k_ref,  # [P, Z, H]  (this kv head)
    v_ref,  # [P, Z, H]
    *rest,
    sm_scale: float,
    soft_cap: Optional[float],
    rules: TileRules,
    group: int,
    block_q: int,
    pages_per_block: int,
    pages_per_split: int,
    quantized: bool,
):
  scale_refs, rest = (rest[:2], rest[2:]) if quantized else ((), rest)  # [P, Z] f32 each
  mask_consts, score_consts, range_consts, outs = rules.split_refs(rest)
  acc_ref, m_ref, l_ref = outs  # [rows, H] f32, [rows] f32, [rows] f32
  _, group_p, head_dim = q_ref.shape
  page_size = k_ref.shape[1]
  rows = block_q * group_p  # query rows of a tile: block_q columns x group_p heads
  block_k = pages_per_block * page_size  # keys per loop step
  split = pl.program_id(2)

  seq = meta_ref[0]
  q_start = meta_ref[1]
  n_rows = meta_ref[2]
  pos0 = meta_ref[3]

  q = q_ref[pl.ds(q_start, block_q), :, :].reshape(rows, head_dim)  # [rows, H]
  compute_dtype = q.dtype
  row_q = lax.broadcasted_iota(jnp.int32, (rows,), 0) // group_p  # [rows]
  row_ok = row_q < n_rows  # [rows]
  row_pos = pos0 + row_q  # [rows]
  # Query head of each row (padding heads of a group reuse its last head).
  row_head = pl.program_id(1) * group + jnp.minimum(
      lax.broadcasted_iota(jnp.int32, (rows,), 0) % group_p, group - 1)  # [rows]

  chunk_lo = split * (pages_per_split * page_size)
  chunk_hi = chunk_lo + pages_per_split * page_size
  lo = chunk_lo
  hi = jnp.minimum(chunk_hi, pos0 + n_rows)  # exclusive; n_rows 0 -> empty
  if rules.kv_range is not None:  # the variant's hint narrows the page walk
    col_pos = pos0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)  # [block_q]
    col_ok = col_pos < pos0 + n_rows
    first, last = (jnp.broadcast_to(b, (block_q,))
                   for b in rules.kv_range(range_consts, col_pos))
    lo = jnp.maximum(lo, jnp.min(jnp.where(col_ok, first, _FAR)))
    hi = jnp.minimum(hi, jnp.max(jnp.where(col_ok, last, 0)))
  lo_page = lo // page_size
  n_steps = jnp.where(hi > lo, pl.cdiv(pl.cdiv(hi, page_size) - lo_page,
                                       pages_per_block), 0)
  precision = (lax.Precision.HIGHEST if compute_dtype == jnp.float32
               else lax.Precision.DEFAULT)

  def attend(pages, key, key_ok, mask, carry):
    acc, m_prev, l_prev = carry  # [rows, H], [rows], [rows]
    k = k_ref[pages].reshape(block_k, head_dim).astype(compute_dtype)  # [block_k, H]
    v = v_ref[pages].reshape(block_k, head_dim)  # [block_k, H]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # [rows, block_k]
    if quantized:
      s = s * scale_refs[0][pages].reshape(1, block_k)
    s = s * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    if rules.score is not None:
      s = jnp.broadcast_to(rules.score(score_consts, s, row_pos[:, None], key[None, :],
                                       row_head[:, None])[0], s.shape).astype(jnp.float32)
    s = jnp.where(mask, s, MASK_VALUE)  # [rows, block_k]
    m_next = jnp.maximum(m_prev, s.max(axis=1))  # [rows]
    alpha = jnp.exp(m_prev - m_next)  # [rows]
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # [rows, block_k]
    l_next = alpha * l_prev + p.sum(axis=1)
    if quantized:
      p = p * scale_refs[1][pages].reshape(1, block_k)
    # Stale slots of partly used pages must not leak NaN/inf through 0 * x.
    v = jnp.where(key_ok[:, None], v.astype(compute_dtype),
                  jnp.zeros((), compute_dtype))
    pv = lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision,
                         preferred_element_type=jnp.float32)  # [rows, H]
    return alpha[:, None] * acc + pv, m_next, l_next

  def body(step, carry):
    page0 = lo_page + step * pages_per_block
    pages = block_tables_ref[seq, pl.ds(page0, pages_per_block)]  # [ppb]
    key = page0 * page_size + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    key_ok = (key >= chunk_lo) & (key < hi)  # [block_k]
    mask = key_ok[None, :] & row_ok[:, None] & (key[None, :] <= row_pos[:, None])
    if rules.mask is None:
      return attend(pages, key, key_ok, mask, carry)
    mask = mask & rules.mask(mask_consts, row_pos[:, None], key[None, :])[0].astype(bool)
    # A step whose keys the variant hides from every row of the tile reads no page.
    return lax.cond(jnp.any(mask), functools.partial(attend, pages, key, key_ok, mask),
                    lambda carry: carry, carry)

  init = (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, m, l = lax.fori_loop(0, n_steps, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _whole_spec(ndim: int, shape: tuple) -> pl.BlockSpec:
  """Every program reads the whole array (a rule's constant)."""
  return pl.BlockSpec(shape, lambda t, h, c: (0,) * ndim)


def _lift_rules(mask_fn, score_fn, kv_range_fn, rows: int, block_k: int, block_q: int):
  """The rules traced at the shapes the kernel body calls them with -> (TileRules, the
  arrays they close over, kernel inputs in TileRules.split_refs order)."""
  pos = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  mask, mask_consts = lift(mask_fn, pos((rows, 1)), pos((1, block_k)))
  score, score_consts = lift(score_fn, jax.ShapeDtypeStruct((rows, block_k), jnp.float32),
                             pos((rows, 1)), pos((1, block_k)), pos((rows, 1)))
  kv_range, range_consts = lift(kv_range_fn, pos((block_q,)))
  return TileRules(mask, score, kv_range), mask_consts + score_consts + range_consts


def _tile_metadata(cu_q_lens, kv_lens, num_tiles, block_q):
  """Per query tile: (seq, q_start, q_rows, pos0); tiles past the work are empty."""
  num_seqs = kv_lens.shape[0]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [B]
  tiles_per_seq = (q_lens + block_q - 1) // block_q  # [B]
  tile_cu = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(tiles_per_seq, dtype=jnp.int32)])
  t = jnp.arange(num_tiles, dtype=jnp.int32)  # [nt]
  seq = segment_of(tile_cu[1:], t)
  valid = seq < num_seqs
  seq_c = jnp.minimum(seq, num_seqs - 1)
  q_off = (t - tile_cu[seq_c]) * block_q
  meta = jnp.stack([
      jnp.where(valid, seq_c, num_seqs),  # row B of the table is all zeros
      jnp.where(valid, cu_q_lens[seq_c] + q_off, 0),
      jnp.where(valid, jnp.minimum(block_q, q_lens[seq_c] - q_off), 0),
      jnp.where(valid, kv_lens[seq_c] - q_lens[seq_c] + q_off, 0),
  ], axis=1)  # [nt, 4]
  return meta.astype(jnp.int32), tile_cu


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "mask_fn", "score_fn",
                     "kv_range_fn", "interpret",
                     "block_q", "pages_per_block", "pages_per_split",
                     "num_warps", "num_stages"))
def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [K, P, Z, H]
    v_pages: jax.Array,  # [K, P, Z, H]
    kv_lens: jax.Array,  # [B] int32
    block_tables: jax.Array,  # [B, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [B + 1] int32
    *,
    sm_scale: float,
    soft_cap: Optional[float] = None,
    k_scales: Optional[jax.Array] = None,  # [K, P, Z] f32
    v_scales: Optional[jax.Array] = None,  # [K, P, Z] f32
    mask_fn: Optional[Callable] = None,
    score_fn: Optional[Callable] = None,
    kv_range_fn: Optional[Callable] = None,
    interpret: bool = False,
    block_q: Optional[int] = None,
    pages_per_block: Optional[int] = None,
    pages_per_split: Optional[int] = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:  # [T, N, H], q.dtype
  """Paged attention over a ragged batch of query chunks; see the module doc.

  The tuning knobs (block_q, pages_per_block, pages_per_split, num_warps,
  num_stages) default to `default_block_sizes`; results do not depend on them
  beyond float rounding.  mask_fn / score_fn / kv_range_fn: an attention variant's
  position rules (pallas_kernels/position_rules.py), applied per tile on logical
  positions; kv_range_fn narrows each tile's page walk, and a step whose keys mask_fn
  hides from the whole tile reads no page.
  """
  quantized = check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
                            sm_scale, soft_cap, k_scales, v_scales)
  check_rules(mask_fn, score_fn, kv_range_fn)
  total_q, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  num_seqs, pages_per_seq = block_tables.shape
  group = num_q_heads // num_kv_heads
  _check_triton_shapes(head_dim, page_size)
  block_q, pages_per_block, pages_per_split = _choose_tiling(
      page_size, head_dim, group, block_q, pages_per_block, pages_per_split)
  group_p = _next_pow2(group)
  rows = block_q * group_p
  num_splits = pl.cdiv(pages_per_seq, pages_per_split)
  num_tiles = max(1, min(total_q, pl.cdiv(total_q, block_q) + num_seqs))

  meta, tile_cu = _tile_metadata(cu_q_lens, kv_lens, num_tiles, block_q)  # [nt, 4]
  tables, q_t = _kernel_layout(q, block_tables, num_kv_heads, num_pages, group_p, block_q,
                               pages_per_block)
  rules, rule_consts = _lift_rules(mask_fn, score_fn, kv_range_fn, rows,
                                   pages_per_block * page_size, block_q)
  kernel = functools.partial(
      _rpa_kernel, sm_scale=float(sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      rules=rules, group=group, block_q=block_q,
      pages_per_block=pages_per_block, pages_per_split=pages_per_split,
      quantized=quantized)
  in_specs, operands = _kernel_inputs(meta, tables, q_t, k_pages, v_pages,
                                      (k_scales, v_scales) if quantized else (), rule_consts)
  acc, m, l = _split_partials(kernel, in_specs, operands,
                              grid=(num_tiles, num_kv_heads, num_splits), rows=rows,
                              head_dim=head_dim, interpret=interpret, num_warps=num_warps,
                              num_stages=num_stages)
  o = _merge_splits(acc, m, l)  # [nt, K, rows, H]
  o = o.reshape(num_tiles, num_kv_heads, block_q, group_p, head_dim)[:, :, :, :group]
  out = _tiles_to_tokens(o, cu_q_lens, tile_cu, total_q, block_q)  # [T, K, Gq, H]
  return out.reshape(total_q, num_q_heads, head_dim).astype(q.dtype)


def _check_triton_shapes(head_dim: int, page_size: int) -> None:
  """The Pallas-Triton lowering's shape needs (a clear error instead of a lowering one)."""
  if not _is_pow2(head_dim) or head_dim < 16:
    raise ValueError(f"head_dim={head_dim}: the Pallas-Triton lowering needs a power of "
                     "two >= 16 (use ragged_paged_attention_reference otherwise)")
  if not _is_pow2(page_size):
    raise ValueError(f"page_size={page_size}: the Pallas-Triton lowering needs a power of two")


def _choose_tiling(page_size: int, head_dim: int, group: int, block_q: Optional[int],
                   pages_per_block: Optional[int], pages_per_split: Optional[int]
                   ) -> tuple[int, int, int]:
  """The caller's tuning knobs, checked, or `default_block_sizes` where None
  -> (block_q, pages_per_block, pages_per_split)."""
  d_bq, d_ppb, d_pps = default_block_sizes(page_size, head_dim, group)
  block_q = d_bq if block_q is None else _next_pow2(max(block_q, d_bq))
  pages_per_block = d_ppb if pages_per_block is None else pages_per_block
  if not _is_pow2(pages_per_block) or pages_per_block * page_size < _MIN_KEYS:
    raise ValueError(f"pages_per_block={pages_per_block} must be a power of two with "
                     f"pages_per_block * page_size >= {_MIN_KEYS}")
  pages_per_split = d_pps if pages_per_split is None else pages_per_split
  if pages_per_split < 1:
    raise ValueError(f"pages_per_split={pages_per_split} must be >= 1")
  return block_q, pages_per_block, pages_per_split


def _kernel_layout(q, block_tables, num_kv_heads: int, num_pages: int, group_p: int,
                   block_q: int, pages_per_block: int):
  """-> (block tables [B+1, pps+ppb], q [K, T + bq, group_p, H]) as the kernel reads them."""
  total_q, num_q_heads, head_dim = q.shape
  group = num_q_heads // num_kv_heads
  # Clamp page ids (unused entries may be -1) and pad so every page-block load
  # and the all-zero row B used by surplus tiles stay in bounds.
  tables = jnp.clip(block_tables, 0, num_pages - 1)
  tables = jnp.pad(tables, ((0, 1), (0, pages_per_block)))  # [B+1, pps+ppb]
  q_t = q.reshape(total_q, num_kv_heads, group, head_dim)  # [T, K, Gq, H]
  q_t = jnp.pad(q_t, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
  return tables, q_t.transpose(1, 0, 2, 3)  # [K, T + bq, group_p, H]


def _kernel_inputs(meta, tables, q_t, k_pages, v_pages, scales: tuple, rule_consts: list):
  """-> (in_specs, operands) of the kernel, in _rpa_kernel's ref order: tile metadata,
  tables, q, K/V pools (one kv head per program), int8 scales if any, rule constants."""
  _, num_pages, page_size, head_dim = k_pages.shape
  pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim),
                           lambda t, h, c: (h, 0, 0, 0))
  in_specs = [
      pl.BlockSpec((None, 4), lambda t, h, c: (t, 0)),
      pl.BlockSpec(tables.shape, lambda t, h, c: (0, 0)),
      pl.BlockSpec((None,) + q_t.shape[1:], lambda t, h, c: (h, 0, 0, 0)),
      pool_spec, pool_spec,
  ]
  operands = [meta, tables, q_t, k_pages, v_pages]
  if scales:
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda t, h, c: (h, 0, 0))
    in_specs += [scale_spec, scale_spec]
    operands += list(scales)
  in_specs += [_whole_spec(c.ndim, c.shape) for c in rule_consts]
  operands += rule_consts
  return in_specs, operands


def _split_partials(kernel, in_specs, operands, *, grid: tuple, rows: int, head_dim: int,
                    interpret: bool, num_warps: int, num_stages: int):
  """The pallas_call over grid (tiles, kv heads, kv splits) -> each program's unnormalized
  f32 (acc [nt, K, splits, rows, H], running max, running sum [nt, K, splits, rows])."""
  part_shape = tuple(grid) + (rows,)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim), lambda t, h, c: (t, h, c, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda t, h, c: (t, h, c, 0)),
          pl.BlockSpec((None, None, None, rows), lambda t, h, c: (t, h, c, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(part_shape + (head_dim,), jnp.float32),  # acc
          jax.ShapeDtypeStruct(part_shape, jnp.float32),  # running max
          jax.ShapeDtypeStruct(part_shape, jnp.float32),  # running sum
      ],
      interpret=interpret,
      compiler_params=compiler_params,
      name="ragged_paged_attention",
  )(*operands)


def _merge_splits(acc, m, l):
  """Log-sum-exp merge of the kv splits (f32) -> normalized output [nt, K, rows, H]."""
  m_all = m.max(axis=2, keepdims=True)  # [nt, K, 1, rows]
  w = jnp.exp(m - m_all)  # [nt, K, splits, rows]
  l_all = (w * l).sum(axis=2)  # [nt, K, rows]
  o = (w[..., None] * acc).sum(axis=2)  # [nt, K, rows, H]
  return o / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def _tiles_to_tokens(o, cu_q_lens, tile_cu, total_q: int, block_q: int):
  """Scatter tiles [nt, K, bq, Gq, H] back to tokens [T, K, Gq, H]: token -> (tile, row
  in tile); padding tokens (at or past cu_q_lens[-1]) are zeros."""
  num_tiles = o.shape[0]
  num_seqs = cu_q_lens.shape[0] - 1
  tok = jnp.arange(total_q, dtype=jnp.int32)  # [T]
  tseq = segment_of(cu_q_lens[1:], tok)
  tvalid = tseq < num_seqs
  tseq = jnp.minimum(tseq, num_seqs - 1)
  i = tok - cu_q_lens[tseq]
  tile = jnp.clip(tile_cu[tseq] + i // block_q, 0, num_tiles - 1)
  out = o[tile, :, i % block_q]  # [T, K, Gq, H]
  return jnp.where(tvalid[:, None, None, None], out, 0.0)
