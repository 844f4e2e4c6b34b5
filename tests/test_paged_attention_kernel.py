"""ragged_paged_attention: kernel (interpret mode) vs reference vs float64 brute force.

The brute force is independent of both: per token, a dense numpy float64
softmax over the K/V gathered from its own sequence's pages.  Tolerances
(f32: 2e-5) sit four orders of magnitude below the error of a k/v swap or of
an off-by-one causal position, which `test_tolerance_catches_*` demonstrate.
"""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from pallas_kernels import ragged_paged_attention_reference
from pallas_kernels.paged_attention import default_block_sizes

F32_TOL = 2e-5
SCALE = 0.125


@dataclasses.dataclass
class Problem:
  q: np.ndarray  # [T, N, H]
  k: np.ndarray  # [K, P, G_page, H]
  v: np.ndarray  # [K, P, G_page, H]
  kv_lens: np.ndarray  # [S]
  tables: np.ndarray  # [S, pages_per_seq]
  cu: np.ndarray  # [S + 1]
  k_scales: np.ndarray | None = None  # [K, P, G_page]
  v_scales: np.ndarray | None = None

  def args(self):
    return (jnp.asarray(self.q), jnp.asarray(self.k), jnp.asarray(self.v),
            jnp.asarray(self.kv_lens), jnp.asarray(self.tables), jnp.asarray(self.cu))

  def scales(self):
    if self.k_scales is None:
      return {}
    return dict(k_scales=jnp.asarray(self.k_scales), v_scales=jnp.asarray(self.v_scales))


def make_problem(q_lens, kv_lens, *, kv_heads=2, group=4, head_dim=64, page_size=16,
                 pages_per_seq=None, pad_tokens=1, dtype=np.float32, int8=False, seed=0):
  rng = np.random.default_rng(seed)
  num_seqs = len(q_lens)
  pages_per_seq = pages_per_seq or max(1, -(-max(kv_lens) // page_size))
  num_pages = num_seqs * pages_per_seq + 3
  tables = rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(
      num_seqs, pages_per_seq).astype(np.int32)
  for s, kv in enumerate(kv_lens):  # unused table entries hold -1
    tables[s, -(-kv // page_size):] = -1
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  total = int(cu[-1]) + pad_tokens
  q = rng.standard_normal((total, kv_heads * group, head_dim)).astype(dtype)
  shape = (kv_heads, num_pages, page_size, head_dim)
  if int8:
    k = rng.integers(-127, 128, shape).astype(np.int8)
    v = rng.integers(-127, 128, shape).astype(np.int8)
    ks = rng.uniform(0.002, 0.02, shape[:3]).astype(np.float32)
    vs = rng.uniform(0.002, 0.02, shape[:3]).astype(np.float32)
    return Problem(q, k, v, np.asarray(kv_lens, np.int32), tables, cu, ks, vs)
  k = rng.standard_normal(shape).astype(dtype)
  v = rng.standard_normal(shape).astype(dtype)
  return Problem(q, k, v, np.asarray(kv_lens, np.int32), tables, cu)


def brute_force(pb: Problem, *, window=None, soft_cap=None, pos_shift=0):
  """float64 numpy: dense softmax over each token's gathered keys."""
  total, num_q_heads, head_dim = pb.q.shape
  kv_heads, _, page_size, _ = pb.k.shape
  group = num_q_heads // kv_heads
  k = pb.k.astype(np.float64)
  v = pb.v.astype(np.float64)
  if pb.k_scales is not None:
    k = k * pb.k_scales[..., None]
    v = v * pb.v_scales[..., None]
  out = np.zeros((total, num_q_heads, head_dim))
  for s, kv_len in enumerate(pb.kv_lens):
    q_len = pb.cu[s + 1] - pb.cu[s]
    keys = np.arange(kv_len)
    pages = pb.tables[s, keys // page_size]
    ks, vs = k[:, pages, keys % page_size], v[:, pages, keys % page_size]  # [K, L, H]
    for i in range(q_len):
      t, p = pb.cu[s] + i, kv_len - q_len + i + pos_shift
      seen = (keys <= p) & ((keys > p - window) if window else True)
      if not seen.any():
        out[t] = np.nan
        continue
      for n in range(num_q_heads):
        sc = ks[n // group][seen] @ pb.q[t, n].astype(np.float64) * SCALE
        if soft_cap:
          sc = soft_cap * np.tanh(sc / soft_cap)
        w = np.exp(sc - sc.max())
        out[t, n] = (w / w.sum()) @ vs[n // group][seen]
  return out


def run_both(pb: Problem, **kw):
  kernel = ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True,
                                  **pb.scales(), **kw)
  ref_kw = {k: v for k, v in kw.items() if k in ("soft_cap", "mask_fn", "score_fn")}
  ref = ragged_paged_attention_reference(*pb.args(), sm_scale=SCALE, **pb.scales(),
                                         **ref_kw)
  return np.asarray(kernel, np.float64), np.asarray(ref, np.float64)


def assert_close(got, want, tol, what):
  err = np.abs(got - want).max()
  assert err <= tol, f"{what}: max |err| {err:.3g} > {tol:.3g}"


# Decode, verify (K+1), chunked prefill, full prefill, kv_len 1, page
# boundaries +-1, empty slots, trailing padding tokens: one ragged batch.
MIXED = dict(q_lens=[1, 4, 0, 7, 1, 1, 16, 1, 0, 3],
             kv_lens=[17, 16, 5, 40, 1, 15, 16, 33, 0, 31])


@pytest.fixture(scope="module", params=[1, 4, 8], ids=lambda g: f"gqa{g}")
def mixed(request):
  pb = make_problem(**MIXED, group=request.param, seed=request.param)
  return pb, brute_force(pb), run_both(pb)


def test_mixed_batch_kernel_matches_bruteforce(mixed):
  pb, want, (kernel, _) = mixed
  assert_close(kernel, want, F32_TOL, "kernel vs brute force")
  assert np.all(kernel[pb.cu[-1]:] == 0), "padding tokens must be zero"


def test_mixed_batch_reference_matches_bruteforce(mixed):
  _, want, (_, ref) = mixed
  assert_close(ref, want, F32_TOL, "reference vs brute force")


def test_tolerance_catches_kv_swap_and_causal_off_by_one(mixed):
  pb, want, (kernel, _) = mixed
  swapped = dataclasses.replace(pb, k=pb.v, v=pb.k)
  assert np.abs(brute_force(swapped) - want).max() > 1000 * F32_TOL
  swapped_out, _ = run_both(swapped)
  assert np.abs(swapped_out - want).max() > 1000 * F32_TOL
  # The position one step earlier: drops the diagonal key (and row 0's only key).
  shifted = brute_force(pb, pos_shift=-1)
  valid = np.isfinite(shifted).all(axis=(1, 2))
  assert np.abs(kernel[valid] - shifted[valid]).max() > 1000 * F32_TOL


def test_decode_only_matches_jax_paged_attention():
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
  kv_lens = [1, 15, 16, 17, 64, 33, 48, 2]
  pb = make_problem([1] * 8, kv_lens, group=8, pages_per_seq=4, pad_tokens=0, seed=3)
  kernel, ref = run_both(pb)
  want = brute_force(pb)
  assert_close(kernel, want, F32_TOL, "kernel vs brute force")
  assert_close(ref, want, F32_TOL, "reference vs brute force")
  tables = np.where(pb.tables < 0, 0, pb.tables)
  theirs = jax_pa.paged_attention(
      jnp.asarray(pb.q * SCALE), jnp.asarray(pb.k), jnp.asarray(pb.v),
      jnp.asarray(tables), jnp.asarray(pb.kv_lens), interpret=True, k_splits=2,
      pages_per_compute_block=2)
  assert_close(kernel, np.asarray(theirs, np.float64), 1e-4, "kernel vs jax paged_attention")


def test_prefill_only():
  pb = make_problem([20, 9], [20, 9], seed=4)
  kernel, ref = run_both(pb, block_q=8)
  want = brute_force(pb)
  assert_close(kernel, want, F32_TOL, "kernel")
  assert_close(ref, want, F32_TOL, "reference")


@pytest.mark.parametrize("window", [1, 5, 20])
def test_sliding_window(window):
  """A window as position rules: the mask, and the range that skips the pages behind it."""
  pb = make_problem(**MIXED, seed=5)
  kernel, ref = run_both(pb, mask_fn=lambda p, j: j > p - window,
                         kv_range_fn=lambda p: (p - window + 1, p + 1), pages_per_split=1)
  want = brute_force(pb, window=window)
  assert_close(kernel, want, F32_TOL, "kernel")
  assert_close(ref, want, F32_TOL, "reference")


def test_int8_kv_with_scales():
  pb = make_problem(**MIXED, int8=True, seed=6)
  kernel, ref = run_both(pb)
  want = brute_force(pb)
  assert_close(kernel, want, F32_TOL, "kernel")
  assert_close(ref, want, F32_TOL, "reference")
  # Swapping the two scale tensors must be caught.
  bad = dataclasses.replace(pb, k_scales=pb.v_scales, v_scales=pb.k_scales)
  assert np.abs(brute_force(bad) - want).max() > 1000 * F32_TOL


def test_soft_cap():
  pb = make_problem(**MIXED, seed=7)
  kernel, ref = run_both(pb, soft_cap=0.5)
  want = brute_force(pb, soft_cap=0.5)
  assert_close(kernel, want, F32_TOL, "kernel")
  assert_close(ref, want, F32_TOL, "reference")
  assert np.abs(want - brute_force(pb)).max() > 1000 * F32_TOL


@pytest.mark.parametrize("head_dim,page_size", [(128, 8), (256, 128)])
def test_head_dims_and_page_sizes(head_dim, page_size):
  pb = make_problem([1, 3, 5], [9, 130, 5], head_dim=head_dim, page_size=page_size,
                    kv_heads=1, seed=8)
  kernel, ref = run_both(pb)
  want = brute_force(pb)
  assert_close(kernel, want, F32_TOL, "kernel")
  assert_close(ref, want, F32_TOL, "reference")


def test_bf16_inputs():
  pb = make_problem(**MIXED, dtype=jnp.bfloat16, seed=9)
  kernel, ref = run_both(pb)
  want = brute_force(pb)
  assert_close(kernel, want, 3e-2, "kernel")
  assert_close(ref, want, 3e-2, "reference")


def test_split_and_batch_invariance():
  pb = make_problem(**MIXED, seed=10)
  base, _ = run_both(pb)
  fine, _ = run_both(pb, pages_per_split=1, pages_per_block=1)
  assert_close(fine, base, 2e-6, "split choice")
  # Sequence 3 alone (same pages) gives the same rows as inside the batch.
  s = 3
  lo, hi = pb.cu[s], pb.cu[s + 1]
  alone = dataclasses.replace(pb, q=pb.q[lo:hi], kv_lens=pb.kv_lens[s:s + 1],
                              tables=pb.tables[s:s + 1],
                              cu=np.array([0, hi - lo], np.int32))
  out, _ = run_both(alone)
  np.testing.assert_array_equal(out, base[lo:hi])


def test_reference_jits_with_traced_metadata():
  pb = make_problem(**MIXED, seed=11)
  fn = jax.jit(chex.assert_max_traces(
      lambda *a: ragged_paged_attention_reference(*a, sm_scale=SCALE), n=1))
  want = brute_force(pb)
  assert_close(np.asarray(fn(*pb.args())), want, F32_TOL, "jit reference")
  kv2 = [max(q, kv - 2) for q, kv in zip(MIXED["q_lens"], MIXED["kv_lens"])]
  pb2 = make_problem(MIXED["q_lens"], kv2, pages_per_seq=3, seed=12)
  assert_close(np.asarray(fn(*pb2.args())), brute_force(pb2), F32_TOL, "retraced?")


def test_default_block_sizes_are_batch_free():
  assert default_block_sizes(16, 128, 4) == (4, 4, 64)
  assert default_block_sizes(8, 256, 1) == (16, 8, 128)
  assert default_block_sizes(128, 64, 8) == (2, 1, 8)


@pytest.mark.parametrize("change,match", [
    (dict(kv_lens=np.zeros(10, np.float32)), "kv_lens.dtype"),
    (dict(cu=np.zeros(10, np.int32)), "cu_q_lens.shape"),
    (dict(tables=np.zeros((9, 3), np.int32)), "block_tables.shape"),
    (dict(q=np.zeros((3, 7, 64), np.float32)), "num_q_heads=7"),
    (dict(q=np.zeros((3, 8, 32), np.float32)), "head_dim of q"),
    (dict(k=np.zeros((2, 43, 4, 64), np.float32)), "k_pages.shape"),
])
def test_wrapper_errors_name_the_bad_value(change, match):
  pb = dataclasses.replace(make_problem(**MIXED), **change)
  with pytest.raises(ValueError, match=match):
    ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True)


def test_lowering_limits_are_clear_errors():
  pb = make_problem([1], [5], head_dim=96)
  with pytest.raises(ValueError, match="head_dim=96"):
    ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True)
  kernel_free = ragged_paged_attention_reference(*pb.args(), sm_scale=SCALE)
  assert_close(np.asarray(kernel_free), brute_force(pb), F32_TOL, "reference hd 96")
  pb = make_problem([1], [5], page_size=4)
  with pytest.raises(ValueError, match="page_size=4"):
    ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True)
  pb = make_problem([1], [5], int8=True)
  with pytest.raises(ValueError, match="need k_scales"):
    ragged_paged_attention(*pb.args(), sm_scale=SCALE, interpret=True)
