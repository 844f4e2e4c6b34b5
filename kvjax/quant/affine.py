"""Affine (min-max) integer quantization: KIVI's int4 KV groups (kvjax/caches/kivi.py).

x ~= c * scale + offset, one float32 scale and offset per slice along `axis`: the
slice's [min, max] split into 2**bits - 1 steps (scale = (max - min) / 15 at 4 bits),
so all 16 codes are used whatever the slice's sign or skew, and rounding errs at most
half a step, (max - min) / 30 -- where the symmetric grid (kvjax/quant/symmetric.py)
errs up to absmax / 14.  Codes are signed, c in [-2**(bits-1), 2**(bits-1) - 1], the
offset absorbing the shift (offset = min + 2**(bits-1) * scale), so symmetric.py's
pack_int4 / unpack_int4 hold them unchanged and dequantization is one multiply-add.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["quantize_affine"]


def quantize_affine(x: jax.Array, bits: int, axis) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x -> (int8 codes, f32 scales, f32 offsets), the last two with `axis` reduced away.

  A constant slice gets scale 1 and dequantizes exactly.  A slice holding NaN or inf gets
  a NaN scale and offset (codes 0), so it dequantizes to NaN and stays visible to the
  engine's non-finite check, as in symmetric.quantize.
  """
  if bits not in (4, 8):
    raise ValueError(f"affine quantization supports 4 or 8 bits, got {bits}")
  shift = 2 ** (bits - 1)
  x = x.astype(jnp.float32)
  # Checked element-wise: XLA's min/max reductions need not propagate NaN.
  finite = jnp.all(jnp.isfinite(x), axis=axis, keepdims=True)
  low = jnp.where(finite, jnp.min(x, axis=axis, keepdims=True), 0.0)
  high = jnp.where(finite, jnp.max(x, axis=axis, keepdims=True), 0.0)
  spread = high - low
  scale = jnp.where(spread > 0, spread / (2 * shift - 1), 1.0)
  steps = jnp.clip(jnp.round((jnp.where(finite, x, 0.0) - low) / scale), 0, 2 * shift - 1)
  codes = jnp.where(finite, steps - shift, 0).astype(jnp.int8)
  offset = jnp.where(finite, low + shift * scale, jnp.nan)
  scale = jnp.where(finite, scale, jnp.nan)
  return codes, jnp.squeeze(scale, axis), jnp.squeeze(offset, axis)
