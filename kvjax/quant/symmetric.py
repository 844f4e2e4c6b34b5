"""Symmetric integer quantization and int4 packing, shared by KV pages and weights.

x ~= q * scale with q in [-qmax, qmax] (qmax = 2**(bits-1) - 1: 127 or 7) and one
float32 scale per slice along `axis` (absmax / qmax).  Symmetric, not affine:
no zero point, so dequantization is one multiply that fuses into the consumer.
The code -2**(bits-1) is never produced, which keeps negation exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["qmax", "quantize", "pack_int4", "unpack_int4"]


def qmax(bits: int) -> int:
  if bits not in (4, 8):
    raise ValueError(f"symmetric quantization supports 4 or 8 bits, got {bits}")
  return 2 ** (bits - 1) - 1


def quantize(x: jax.Array, bits: int, axis) -> tuple[jax.Array, jax.Array]:
  """x -> (int8 codes, f32 scales with `axis` reduced away); all-zero slices get scale 1.

  A slice holding NaN or inf gets a NaN scale (and codes 0), so it dequantizes to NaN:
  codes alone would turn a non-finite slice into finite values and hide it from the
  engine's non-finite check (kvjax/runtime/serve_steps.py) behind an int8/int4 KV cache.
  """
  top = qmax(bits)
  x = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  # Checked element-wise: XLA's max reduction need not propagate NaN (wide slices).
  finite = jnp.all(jnp.isfinite(x), axis=axis, keepdims=True)
  scale = jnp.where(finite, jnp.where(absmax > 0, absmax / top, 1.0), jnp.nan)
  safe = jnp.where(finite, scale, 1.0)
  codes = jnp.where(finite, jnp.clip(jnp.round(x / safe), -top, top), 0).astype(jnp.int8)
  return codes, jnp.squeeze(scale, axis)


def pack_int4(codes: jax.Array) -> jax.Array:
  """int8 codes in [-8, 7], last dim 2M -> int8 [..., M]: even index low nibble, odd high."""
  lo, hi = codes[..., 0::2], codes[..., 1::2]
  return (lo & 0xF) | jnp.left_shift(hi, 4)


def unpack_int4(packed: jax.Array) -> jax.Array:
  """Inverse of pack_int4 (arithmetic shifts sign-extend each nibble) -> int8 [..., 2M]."""
  lo = jnp.right_shift(jnp.left_shift(packed, 4), 4)
  hi = jnp.right_shift(packed, 4)
  return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
