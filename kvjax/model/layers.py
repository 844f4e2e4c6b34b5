"""Numerics shared by every attention variant: RMSNorm, rotary embeddings, dense.

Kept apart from decoder.py so attention variants (kvjax/attention/, the caches) can
use them without importing the decoder that dispatches to them.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.lora.weight import LoraWeight, lora_delta
from kvjax.model import invariance
from kvjax.model.config import ModelConfig, YarnScaling
from kvjax.quant import qmatmul
from kvjax.quant.qweight import ActivationProbe, QuantizedWeight

__all__ = ["rms_norm", "rope_inv_freq", "rope_attention_factor", "apply_rope", "dense",
           "matmul_precision"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """[H/2] inverse frequencies, with Llama-3.1 or YaRN scaling.

  MLA rotates only its decoupled rope dims (qk_rope_head_dim), not the whole head.
  """
  h = cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  sc = cfg.rope_scaling
  if sc is None:
    return inv_freq
  if isinstance(sc, YarnScaling):
    return _yarn_inv_freq(sc, inv_freq, h, cfg.rope_theta)
  low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
  high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
      sc.high_freq_factor - sc.low_freq_factor)
  smoothed = (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
  is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(sc: YarnScaling, inv_freq: jax.Array, h: int, theta: float) -> jax.Array:
  """HF's _compute_yarn_parameters: the dims that turn fewer than `beta_slow` times over
  the original context interpolate (inv_freq / factor), more than `beta_fast` times
  extrapolate (inv_freq), a linear ramp between."""
  def correction_dim(rotations):  # the dim that turns `rotations` times over the context
    return h * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(theta))

  low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
  if sc.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, h - 1)
  if low == high:
    high += 0.001  # as HF: no zero-width ramp
  ramp = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  return inv_freq / sc.factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(cfg: ModelConfig) -> float:
  """The factor YaRN scales rope's cos and sin by (so q . k by its square); 1 otherwise."""
  sc = cfg.rope_scaling
  return sc.attention_factor if isinstance(sc, YarnScaling) else 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               scale: float = 1.0) -> jax.Array:
  """x [B, T, heads, H], positions [B, T]: rotate-half rope (HF convention), cos and sin
  times `scale` (`rope_attention_factor`)."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def matmul_precision(dtype):
  """Trace-time context: full-f32 matmuls for float32 models, the backend default otherwise.

  GPUs run float32 dots in TF32 by default, rounding operands to 10 mantissa
  bits by amounts that depend on the kernel a shape selects, so a 3-token
  verify and a 1-token decode of the same positions could disagree on a greedy
  argmax (speculative greedy must equal plain greedy).  On CPU float32 dots are
  full precision either way; bf16 models keep the default.
  """
  return jax.default_matmul_precision(
      "highest" if jnp.dtype(dtype) == jnp.float32 else "default")


def dense(spec: str, x: jax.Array, w, **dot_kwargs) -> jax.Array:
  """einsum(spec, x, w) where w is an array or a QuantizedWeight (dequantized here).

  Every projection goes through this one site, so a quantized Params pytree
  (kvjax/weights/quantize.py) runs through the unchanged model code; an
  ActivationProbe (calibration, eager only) records x on the way.  A spec that
  contracts x's trailing axes with w's leading ones ("btnh,nhd->btd") runs as
  one 2-D matmul [rows, I] @ [I, O] of the row-major arrays: left to einsum,
  XLA:CPU may pick an axis order that transposes the weight on every call.  A
  LoraWeight (kvjax/lora/weight.py) adds each row's adapter delta to its base's product.  A
  QuantizedWeight times at most qmatmul.MAX_ROWS rows (decode and verify steps) runs
  kvjax/quant/qmatmul.py's custom call where it is available (XLA:CPU), which reads
  the integer codes once; wider inputs (prefill) dequantize for XLA's dot.
  """
  if isinstance(w, ActivationProbe):
    w.observe(x)
    w = w.weight
  inputs, out_axes = spec.split("->")
  x_axes, w_axes = inputs.split(",")
  num_in = sum(axis in x_axes for axis in w_axes)  # contracted axes
  row_axes = x_axes[:len(x_axes) - num_in]
  matrix = x_axes.endswith(w_axes[:num_in]) and out_axes == row_axes + w_axes[num_in:]
  size_in = math.prod(w.shape[:num_in])
  out_shape = x.shape[:x.ndim - num_in] + tuple(w.shape[num_in:])
  if isinstance(w, LoraWeight):  # the base projection plus each row's adapter delta
    if not matrix:
      raise ValueError(f"a LoRA projection needs x's trailing axes contracted, got {spec!r}")
    out = dense(spec, x, w.base, **dot_kwargs)
    return out if w.rows is None else out + lora_delta(x, w, out_shape).astype(out.dtype)
  if isinstance(w, QuantizedWeight) and matrix and x.size // size_in <= qmatmul.MAX_ROWS \
      and qmatmul.available():  # decode and verify rows: read the codes, not a float copy
    out = qmatmul.qmatmul(x.reshape(-1, size_in), w)
    return out.astype(dot_kwargs.get("preferred_element_type") or x.dtype).reshape(out_shape)
  if isinstance(w, QuantizedWeight):
    # Tied to x, the dequantization stays beside its matmul: left loop-invariant, XLA
    # hoists it out of a decode loop and every step reads the float weight it made.
    x, w = jax.lax.optimization_barrier((x, w))
    w = w.dequantize(x.dtype)
  if not matrix:
    return jnp.einsum(spec, x, w, **dot_kwargs)
  w = w.reshape(size_in, -1)
  rows = x.reshape(-1, size_in)
  if invariance.is_on():  # the same tile GEMM whatever the row count (kvjax/model/invariance.py)
    return invariance.tiled_rows(lambda tile: jnp.matmul(tile, w, **dot_kwargs),
                                 rows).reshape(out_shape)
  return jnp.matmul(rows, w, **dot_kwargs).reshape(out_shape)
