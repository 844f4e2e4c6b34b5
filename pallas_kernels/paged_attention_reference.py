"""Ragged paged attention's contract: its input checks, the token -> sequence map and
the pure-jnp oracle (`ragged_paged_attention_reference`) that paged_attention.py's
kernel is tested against (tests/test_paged_attention_kernel.py), same shapes, same
semantics (paged_attention.py's docstring).  Dimension letters: docs/DIMENSIONS.md.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.position_rules import check_rules

__all__ = ["ragged_paged_attention_reference", "check_q_and_pages", "check_inputs",
           "segment_of"]


def segment_of(ends, idx):
  """Segment holding each idx, given segment end offsets: #(ends <= idx).

  compare_all is a fused compare-and-sum: no while loop (which would cost a
  device round trip per step on GPU).
  """
  return jnp.searchsorted(ends, idx, side="right", method="compare_all").astype(jnp.int32)


def check_q_and_pages(q, k_pages, v_pages, q_rows: str = "total_q_tokens"):
  """q [q_rows, num_q_heads, head_dim] and K/V pages [K, P, Z, H] that fit together.

  Shared with mosaic_decode.py.
  """
  if q.ndim != 3:
    raise ValueError(f"q must be [{q_rows}, num_q_heads, head_dim], got shape {q.shape}")
  if k_pages.ndim != 4:
    raise ValueError("k_pages must be [num_kv_heads, num_pages, page_size, head_dim], "
                     f"got shape {k_pages.shape}")
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages.shape {k_pages.shape} != v_pages.shape {v_pages.shape}")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages.dtype {k_pages.dtype} != v_pages.dtype {v_pages.dtype}")
  _, num_q_heads, head_dim = q.shape
  num_kv_heads, _, _, head_dim_k = k_pages.shape
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q.dtype must be floating, got {q.dtype}")
  if head_dim_k != head_dim:
    raise ValueError(f"head_dim of q ({head_dim}) != head_dim of k_pages ({head_dim_k})")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                     f"num_kv_heads={num_kv_heads}")


def check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
                  sm_scale, soft_cap, k_scales, v_scales):
  check_q_and_pages(q, k_pages, v_pages)
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  if not 8 <= page_size <= 128:
    raise ValueError(f"page_size={page_size} must be in [8, 128]")
  for name, arr, ndim in (("kv_lens", kv_lens, 1), ("block_tables", block_tables, 2),
                          ("cu_q_lens", cu_q_lens, 1)):
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name}.dtype must be int32, got {arr.dtype}")
    if arr.ndim != ndim:
      raise ValueError(f"{name} must have rank {ndim}, got shape {arr.shape}")
  num_seqs = kv_lens.shape[0]
  if num_seqs < 1:
    raise ValueError(f"kv_lens must hold at least one sequence, got shape {kv_lens.shape}")
  if block_tables.shape[0] != num_seqs:
    raise ValueError(f"block_tables.shape[0]={block_tables.shape[0]} != "
                     f"num_seqs={num_seqs} (kv_lens.shape[0])")
  if cu_q_lens.shape != (num_seqs + 1,):
    raise ValueError(f"cu_q_lens.shape {cu_q_lens.shape} != (num_seqs + 1,) = "
                     f"({num_seqs + 1},)")
  if not isinstance(sm_scale, (int, float)):
    raise ValueError(f"sm_scale must be a static Python float, got {sm_scale!r}")
  if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
    raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
  quantized = k_pages.dtype == jnp.int8
  if quantized:
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
      if s is None:
        raise ValueError(f"int8 k_pages/v_pages need {name}")
      if s.shape != (num_kv_heads, num_pages, page_size):
        raise ValueError(f"{name}.shape {s.shape} != (num_kv_heads, num_pages, page_size) "
                         f"= {(num_kv_heads, num_pages, page_size)}")
      if s.dtype != jnp.float32:
        raise ValueError(f"{name}.dtype must be float32, got {s.dtype}")
  elif k_scales is not None or v_scales is not None:
    raise ValueError(f"k_scales/v_scales are only for int8 pages, got pages of {k_pages.dtype}")
  elif not jnp.issubdtype(k_pages.dtype, jnp.floating):
    raise ValueError(f"k_pages.dtype must be floating or int8, got {k_pages.dtype}")
  return quantized


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "mask_fn", "score_fn"))
def ragged_paged_attention_reference(
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
) -> jax.Array:  # [T, N, H], q.dtype
  """Pure-jnp oracle: per token, gather its sequence's pages and softmax densely.
  mask_fn / score_fn: an attention variant's rules (pallas_kernels/position_rules.py);
  a kv_range hint has nothing to skip here.

  Jit-able with traced kv_lens/block_tables/cu_q_lens.  Tokens are processed in
  chunks (lax.map) so memory stays at chunk * kv_len * K * H; work is linear in
  T * kv_len (no [T, S] blow-up), which keeps it usable as a CPU backend.
  Any head_dim and page_size are accepted.
  """
  check_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
                sm_scale, soft_cap, k_scales, v_scales)
  check_rules(mask_fn, score_fn, None)
  total_q, num_q_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  num_seqs, pages_per_seq = block_tables.shape
  group = num_q_heads // num_kv_heads
  max_kv = pages_per_seq * page_size
  tables = jnp.clip(block_tables, 0, num_pages - 1)
  f32 = jnp.float32
  heads = jnp.arange(num_q_heads, dtype=jnp.int32).reshape(num_kv_heads, group, 1)

  tok = jnp.arange(total_q, dtype=jnp.int32)  # [T]
  tseq = segment_of(cu_q_lens[1:], tok)
  tvalid = tseq < num_seqs
  tseq = jnp.minimum(tseq, num_seqs - 1)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  tpos = kv_lens[tseq] - q_lens[tseq] + tok - cu_q_lens[tseq]  # [T]

  def one_token(args):
    q_t, seq, pos, ok = args  # [N, H], (), (), ()
    pages = tables[seq]  # [pages_per_seq]
    k = k_pages[:, pages].reshape(num_kv_heads, max_kv, head_dim).astype(f32)
    v = v_pages[:, pages].reshape(num_kv_heads, max_kv, head_dim).astype(f32)
    if k_scales is not None:
      k = k * k_scales[:, pages].reshape(num_kv_heads, max_kv, 1)
      v = v * v_scales[:, pages].reshape(num_kv_heads, max_kv, 1)
    qg = q_t.reshape(num_kv_heads, group, head_dim).astype(f32)  # [K, Gq, H]
    s = jnp.einsum("kgh,ksh->kgs", qg, k, precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    key = jnp.arange(max_kv, dtype=jnp.int32)  # [S]
    if score_fn is not None:
      s = jnp.broadcast_to(score_fn(s, pos, key, heads), s.shape).astype(f32)
    mask = key <= pos
    if mask_fn is not None:
      mask = mask & jnp.broadcast_to(mask_fn(pos, key), mask.shape).astype(bool)
    s = jnp.where(mask, s, -jnp.inf)
    s = s - jax.lax.stop_gradient(s.max(axis=-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s), 0.0)  # [K, Gq, S]
    v = jnp.where(mask[None, :, None], v, 0.0)
    o = jnp.einsum("kgs,ksh->kgh", p, v, precision=lax.Precision.HIGHEST)
    o = o / p.sum(axis=-1, keepdims=True)
    return jnp.where(ok, o, 0.0).reshape(num_q_heads, head_dim)

  bytes_per_token = max_kv * num_kv_heads * head_dim * 4 * 2
  chunk = int(max(1, min(total_q, (256 << 20) // max(1, bytes_per_token))))
  out = lax.map(one_token, (q, tseq, tpos, tvalid), batch_size=chunk)  # [T, N, H]
  return out.astype(q.dtype)
