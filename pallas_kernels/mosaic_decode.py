"""Paged decode in Mosaic GPU (Pallas `plgpu`, Hopper): pages streamed by TMA, wgmma.

Three layers in one file, as in paged_attention.py: the kernel body
(`_decode_body`), the jitted wrapper that validates and lays out
(`mosaic_paged_decode`), and the pure-jnp oracle (`mosaic_paged_decode_reference`).

Semantics.  One query token per sequence attends to every key of its
sequence: key j of sequence b is row j % page_size of page
block_tables[b, j // page_size], so a sequence holds exactly
pages_per_seq * page_size keys (full context: no lengths, no causal mask, no
window, no int8; ragged batches are ragged_paged_attention's job).  Scores are
sm_scale * q.k, the softmax runs in float32, the output comes back in q.dtype.
Precondition the wrapper cannot check on traced values: every entry of
block_tables is a page id in [0, num_pages).

Kernel design.  One CTA (one warpgroup) per (sequence, kv head).  Each step
gathers 64 keys (64 / page_size pages) of K and V with TMA into a `slots`-deep
SMEM ring, one mbarrier per slot, while the step `slots` behind it computes:
two wgmmas (the kv head's group of q heads padded to 64 rows) and an online
softmax.  No split-K: a batch of few sequences keeps few SMs busy.  Measured on
the H200 (jax 0.11.2, bf16, 32 q / 8 kv heads, head_dim 128, page 16;
results/kernel_bench.json "mosaic_trial"): 3.34 TB/s at batch 64 x 8k context,
3.52 TB/s at 64 x 32k, 1.7 TB/s at 8 x 32k (paged_attention.py's docstring
weighs it against the Triton kernel).

Interpret mode (`interpret=True`: jax's GPU interpreter, InterpretGPUParams, on
the CPU) cannot run a wgmma with a transposed operand, nor layout_cast, so
there the two matmuls are jnp dots and the casts are dropped; the TMA copies,
barriers and the ring are the same code.  Mosaic GPU is imported on first use:
this module imports, and its reference runs, where Mosaic GPU cannot import.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels.paged_attention_reference import check_q_and_pages

__all__ = ["mosaic_paged_decode", "mosaic_paged_decode_reference"]

ROWS = 64  # wgmma M: the q heads of one kv head, padded.
BLOCK_KEYS = 64  # keys per pipeline step.


def _plgpu():
  """jax.experimental.pallas.mosaic_gpu, imported on first use."""
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("mosaic_paged_decode needs Pallas' Mosaic GPU backend "
                      "(jax.experimental.pallas.mosaic_gpu), which this jax cannot import; "
                      "use mosaic_paged_decode_reference") from e
  return plgpu


def _interpret_params():
  """InterpretGPUParams(): public in newer jax, under jax._src in older ones."""
  params = getattr(_plgpu(), "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import (  # pylint: disable=g-import-not-at-top
        InterpretGPUParams as params)
  return params()


def _check_shapes(q, k_pages, v_pages, block_tables, sm_scale):
  """Checks of the contract shared by the kernel and the reference."""
  check_q_and_pages(q, k_pages, v_pages, q_rows="batch")
  if q.dtype != k_pages.dtype:
    raise ValueError(f"q.dtype {q.dtype} != k_pages.dtype {k_pages.dtype}")
  batch = q.shape[0]
  if block_tables.dtype != jnp.int32:
    raise ValueError(f"block_tables.dtype must be int32, got {block_tables.dtype}")
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(f"block_tables must be [batch={batch}, pages_per_seq], got shape "
                     f"{block_tables.shape}")
  if block_tables.shape[1] < 1:
    raise ValueError("block_tables must give each sequence at least one page, got shape "
                     f"{block_tables.shape}")
  if not isinstance(sm_scale, (int, float)):
    raise ValueError(f"sm_scale must be a static Python float, got {sm_scale!r}")


def _check_kernel_limits(q, k_pages, block_tables, slots):
  """What the kernel's tiling adds to the contract."""
  _, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"q.dtype must be bfloat16 or float16 (wgmma operands), got {q.dtype}")
  if head_dim % 64:
    raise ValueError(f"head_dim={head_dim} must be a multiple of 64 (128-byte swizzled "
                     "SMEM tiles)")
  if num_q_heads // num_kv_heads > ROWS:
    raise ValueError(f"num_q_heads / num_kv_heads = {num_q_heads // num_kv_heads} q heads per "
                     f"kv head; the kernel packs at most {ROWS}")
  if page_size not in (8, 16, 32, 64):
    raise ValueError(f"page_size={page_size} must be 8, 16, 32 or 64 (whole pages per "
                     f"{BLOCK_KEYS}-key step, 8-row tiles)")
  keys = block_tables.shape[1] * page_size
  if keys % BLOCK_KEYS:
    raise ValueError(f"pages_per_seq * page_size = {block_tables.shape[1]} * {page_size} = "
                     f"{keys} keys must be a multiple of {BLOCK_KEYS}")
  if not isinstance(slots, int) or slots < 1:
    raise ValueError(f"slots must be an int >= 1, got {slots!r}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "slots", "interpret"))
def mosaic_paged_decode(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [batch, pages_per_seq] int32
    *,
    sm_scale: float,
    slots: int = 4,
    interpret: bool = False,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
  """Full-context paged decode through the Mosaic GPU kernel; see the module doc.

  `slots` is the depth of the SMEM ring (capped at the number of steps);
  `interpret` runs jax's GPU interpreter on the CPU, with jnp dots for the wgmmas.
  """
  _check_shapes(q, k_pages, v_pages, block_tables, sm_scale)
  _check_kernel_limits(q, k_pages, block_tables, slots)
  plgpu = _plgpu()
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  pages_per_step = BLOCK_KEYS // page_size
  steps = block_tables.shape[1] // pages_per_step
  slots = min(slots, steps)
  qp = q.reshape(batch, num_kv_heads, group, head_dim)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [batch, kv heads, ROWS, hd]
  body = functools.partial(_decode_body, plgpu, sm_scale=sm_scale, slots=slots, steps=steps,
                           page_size=page_size, pages_per_step=pages_per_step,
                           head_dim=head_dim, emulate=interpret)
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  kern = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, ROWS, head_dim), jnp.float32),
      grid=(batch, num_kv_heads), grid_names=("b", "h"),
      scratch_types=[
          plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=transforms),
          plgpu.SMEM((slots, BLOCK_KEYS, head_dim), k_pages.dtype, transforms=transforms),
          plgpu.SMEM((slots, BLOCK_KEYS, head_dim), v_pages.dtype, transforms=transforms),
          plgpu.SMEM((ROWS, head_dim), jnp.float32),
          plgpu.Barrier(),
          plgpu.Barrier(num_arrivals=2 * pages_per_step, num_barriers=slots)],
      **(dict(interpret=_interpret_params()) if interpret else {}))
  o = kern(block_tables, qp, k_pages, v_pages)
  return o[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _decode_body(plgpu, tables_gmem, q_gmem, k_gmem, v_gmem, o_gmem, q_smem, k_smem, v_smem,
                 o_smem, q_bar, kv_bar, *, sm_scale, slots, steps, page_size, pages_per_step,
                 head_dim, emulate):
  """One (sequence b, kv head h): stream its pages through the ring, online softmax."""
  cast = (lambda x, layout: x) if emulate else plgpu.layout_cast
  b = lax.axis_index("b")
  h = lax.axis_index("h")
  plgpu.copy_gmem_to_smem(q_gmem.at[b, h], q_smem, q_bar)

  def issue(step, slot):  # TMA: the step's pages of K and V into ring slot `slot`
    for j in range(pages_per_step):
      page = tables_gmem[b, step * pages_per_step + j]
      dst = pl.ds(j * page_size, page_size)
      plgpu.copy_gmem_to_smem(k_gmem.at[h, page], k_smem.at[slot, dst], kv_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_gmem.at[h, page], v_smem.at[slot, dst], kv_bar.at[slot])

  for s in range(slots):
    issue(s, s)
  plgpu.barrier_wait(q_bar)

  def loop(step, carry):
    acc, m_i, l_i = carry  # [ROWS, head_dim], [ROWS], [ROWS] f32
    slot = lax.rem(step, slots)
    plgpu.barrier_wait(kv_bar.at[slot])
    if emulate:
      s = lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    else:
      def qk_scope(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS, BLOCK_KEYS), jnp.float32))
    s = s * sm_scale  # [ROWS, BLOCK_KEYS]
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp(m_i - m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p16 = p.astype(q_smem.dtype)
    if emulate:
      pv = jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
    else:
      def pv_scope(pv_ref):
        plgpu.wgmma(pv_ref, p16, v_smem.at[slot])
        return pv_ref[...]
      pv = pl.run_scoped(pv_scope, plgpu.ACC((ROWS, head_dim), jnp.float32))
    acc = acc + pv
    nxt = step + slots

    @pl.when(nxt < steps)
    def _():
      issue(nxt, slot)

    return acc, m_new, l_i

  acc0 = cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  m0 = cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  l0 = cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  acc, m_i, l_i = lax.fori_loop(0, steps, loop, (acc0, m0, l0))
  del m_i
  o_smem[...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def mosaic_paged_decode_reference(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # [batch, pages_per_seq] int32
    *,
    sm_scale: float,
) -> jax.Array:  # [batch, num_q_heads, head_dim], q.dtype
  """Pure-jnp oracle: per sequence, gather its pages and softmax densely in float32.

  Any float dtype, head_dim, page size and page count (none of the kernel's
  tiling limits).
  """
  _check_shapes(q, k_pages, v_pages, block_tables, sm_scale)
  _, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  group = num_q_heads // num_kv_heads
  f32, highest = jnp.float32, lax.Precision.HIGHEST

  def one_sequence(q_b, table):  # [num_q_heads, head_dim], [pages_per_seq]
    keys = k_pages[:, table].reshape(num_kv_heads, -1, head_dim).astype(f32)  # [kv, S, hd]
    values = v_pages[:, table].reshape(num_kv_heads, -1, head_dim).astype(f32)
    qg = q_b.reshape(num_kv_heads, group, head_dim).astype(f32)  # [kv, group, hd]
    scores = jnp.einsum("kgh,ksh->kgs", qg, keys, precision=highest) * sm_scale
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgs,ksh->kgh", weights, values, precision=highest)
    return out.reshape(num_q_heads, head_dim)

  return jax.vmap(one_sequence)(q, block_tables).astype(q.dtype)
