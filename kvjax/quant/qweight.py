"""A weight stored as integer codes: the leaf `layers.dense` dequantizes on the fly.

A weight of shape [*in, *out] (the contracted input axes first, as everywhere
in kvjax) is viewed as a matrix [I, O].  Codes are int8 [I, O] (bits 8) or two
int4 codes per byte along I, [I/2, O] (bits 4).  Scales are f32 [ceil(I/group), O]:
one group spanning all of I is per-output-channel quantization (int8's usual
scheme), groups of 32-128 input rows are int4's group-wise scheme; when the
group does not divide I the last group is shorter (tiny-code's D = 192, g128).

`in_scale` [I] is AWQ's activation-aware scaling kept inside the weight: the
codes quantize diag(s) W and dequantization divides row i by s_i again, so a
salient input channel (large s_i) gets s_i times less rounding error.  AWQ
proper folds 1/s into the op that produces x; keeping it here applies to every
projection alike (wo and w_down included) for I extra floats per weight.

`offsets` [ceil(I/group), O] is an affine zero point per group, w = codes * scale
+ offset: GGUF's Q4_1 / Q4_K blocks (d * q + m, q in 0..15) keep their numbers
exactly as int4 codes q - 8 with offset m + 8d (kvjax/weights/gguf_quants.py);
kvjax's own symmetric schemes leave it None.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.quant.symmetric import pack_int4, quantize, unpack_int4

__all__ = ["QuantizedWeight", "quantize_weight", "ActivationProbe"]


@struct.dataclass
class QuantizedWeight:
  codes: jax.Array  # [I, O] int8, or [I/2, O] packed int4
  scales: jax.Array  # [ceil(I / group), O] f32
  in_scale: Optional[jax.Array] = None  # [I] f32 AWQ scaling, None without AWQ
  offsets: Optional[jax.Array] = None  # [ceil(I / group), O] f32 zero points, None = symmetric
  shape: tuple = struct.field(pytree_node=False, default=())  # original [*in, *out]
  num_in: int = struct.field(pytree_node=False, default=1)  # leading axes contracted
  bits: int = struct.field(pytree_node=False, default=8)
  group_size: int = struct.field(pytree_node=False, default=0)  # rows per scale

  def dequantize(self, dtype) -> jax.Array:
    """The float weight, original shape, in `dtype` (fused into the matmul under jit)."""
    codes = unpack_int4(self.codes.T).T if self.bits == 4 else self.codes  # [I, O]
    rows, cols = codes.shape
    groups = self.scales.shape[0]
    codes = jnp.pad(codes, ((0, groups * self.group_size - rows), (0, 0)))  # ragged last group
    grouped = codes.reshape(groups, self.group_size, cols).astype(jnp.float32)
    grouped = grouped * self.scales[:, None]
    if self.offsets is not None:
      grouped = grouped + self.offsets[:, None]
    w = grouped.reshape(-1, cols)[:rows]
    if self.in_scale is not None:
      w = w / self.in_scale[:, None]
    return w.astype(dtype).reshape(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes a decode step reads for this weight: codes, scales, in_scale and offsets."""
    leaves = [x for x in (self.codes, self.scales, self.in_scale, self.offsets) if x is not None]
    return sum(int(x.size) * x.dtype.itemsize for x in leaves)


@functools.partial(jax.jit, static_argnames=("num_in", "bits", "group_size"))
def quantize_weight(w: jax.Array, *, num_in: int, bits: int, group_size: Optional[int],
                    in_scale: Optional[jax.Array] = None) -> QuantizedWeight:
  """w [*in, *out] -> QuantizedWeight; group_size None = one group per output channel."""
  rows = int(np.prod(w.shape[:num_in]))
  matrix = w.reshape(rows, -1).astype(jnp.float32)  # [I, O]
  group = rows if group_size is None else group_size
  if group <= 0 or (bits == 4 and rows % 2):
    raise ValueError(f"bad group_size={group} for a {w.shape} weight (int4 also needs an "
                     "even input size)")
  if in_scale is not None:
    matrix = matrix * in_scale[:, None]
  groups = -(-rows // group)  # the last group may be ragged; zero rows leave absmax alone
  padded = jnp.pad(matrix, ((0, groups * group - rows), (0, 0)))
  codes, scales = quantize(padded.reshape(groups, group, -1), bits, axis=1)  # [I/group, O]
  codes = codes.reshape(groups * group, -1)[:rows]
  if bits == 4:
    codes = pack_int4(codes.T).T  # pairs along I
  return QuantizedWeight(codes=codes, scales=scales, in_scale=in_scale, shape=tuple(w.shape),
                         num_in=num_in, bits=bits, group_size=group)


class ActivationProbe:
  """Calibration only (eager, never jitted): a float weight that keeps its inputs.

  `layers.dense` calls `observe(x)` with the matmul's input; the rows (flattened
  to [tokens, I]) are what AWQ's scale search measures output error on.
  """

  def __init__(self, weight: jax.Array, num_in: int):
    self.weight = weight
    self.num_in = num_in
    self.inputs: list = []

  def observe(self, x: jax.Array) -> None:
    rows = int(np.prod(self.weight.shape[:self.num_in]))
    self.inputs.append(np.asarray(x, np.float32).reshape(-1, rows))
