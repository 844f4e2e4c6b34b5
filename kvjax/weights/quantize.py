"""Weight-only quantization of any loaded model: int8 per channel, int4 group-wise, AWQ.

`quantize_params` returns the same Params pytree with its projections replaced
by `QuantizedWeight` leaves (kvjax/quant/qweight.py); the model code is
unchanged because every matmul goes through `layers.dense`.  Quantized: the
GQA projections (wq, wk, wv, wo), the MLP (w_gate, w_up, w_down) of every block
and MTP block, every routed and shared expert of an MoE layer (its router stays
float: the choice of experts is not rounded), and an untied lm_head.  A tied head
gets its own int8 codes, `tied_head`: one scale per vocabulary row of the
embedding, whatever the scheme (the head reads the whole [V, D] table every
step: 113 MB in float32 for SmolLM2-135M, 28 MB as int8 codes), so
Params.lm_head is set and the embedding stays float for its gather. Kept in
float: embeddings (a gather reads B rows per step, not the table), norms, MTP
input projections and MLA's attention weights (its absorbed up-projections
contract over their output axis; only its MLP is quantized).

Schemes (claim C12: 16 -> 4 bits is ~4x fewer weight bytes per decode step):
  int8        one f32 scale per output channel: 1 B + 4/I B per weight
  int4-gN     one f32 scale per N input rows per output channel (N = 32, 64,
              128): 0.5 B + 4/N B per weight
AWQ (`calibration_tokens`, models without experts): inputs of every projection
are recorded on calibration text; per weight, s = mean|x|^alpha (normalized)
with alpha from a small grid minimizing ||X W - X W_q||^2 on those inputs
(alpha = 0 is plain rounding, so AWQ never does worse on the calibration data).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.params import AttentionParams, BlockParams, Params
from kvjax.quant.qweight import ActivationProbe, QuantizedWeight, quantize_weight

__all__ = ["SCHEMES", "AWQ_ALPHAS", "weight_scheme", "quantize_params", "tied_head",
           "weight_bytes", "decode_step_weight_bytes"]

SCHEMES = {"int8": (8, None), "int4-g32": (4, 32), "int4-g64": (4, 64), "int4-g128": (4, 128)}
AWQ_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
_ATTENTION = {"wq": 1, "wk": 1, "wv": 1, "wo": 2}  # weight -> leading (input) axes
_MLP = {"w_gate": 1, "w_up": 1, "w_down": 1}
_CALIBRATION_ROWS = 2048  # input rows kept per weight for the AWQ search


def _map_weights(params: Params, fn: Callable) -> Params:
  """Apply fn(weight, num_in, name) to every quantizable projection."""

  def mlp(holder, name: str) -> dict:
    return {k: fn(getattr(holder, k), n, f"{name}.{k}") for k, n in _MLP.items()}

  def block(b: BlockParams, name: str) -> BlockParams:
    changes = {} if b.w_gate is None else mlp(b, name)
    if b.moe is not None:  # every routed and shared expert; the router stays float
      experts = tuple(e.replace(**mlp(e, f"{name}.moe.experts.{i}"))
                      for i, e in enumerate(b.moe.experts))
      shared = b.moe.shared and b.moe.shared.replace(**mlp(b.moe.shared, f"{name}.moe.shared"))
      changes["moe"] = b.moe.replace(experts=experts, shared=shared)
    if isinstance(b.attn, AttentionParams):
      attn = b.attn.replace(**{k: fn(getattr(b.attn, k), n, f"{name}.attn.{k}")
                               for k, n in _ATTENTION.items()})
      changes["attn"] = attn
    return b.replace(**changes)

  blocks = tuple(block(b, f"blocks.{i}") for i, b in enumerate(params.blocks))
  mtp = tuple(m.replace(block=block(m.block, f"mtp.{i}")) for i, m in enumerate(params.mtp))
  head = None if params.lm_head is None else fn(params.lm_head, 1, "lm_head")
  return params.replace(blocks=blocks, mtp=mtp, lm_head=head)


def _calibrate(params: Params, cfg: ModelConfig, tokens: np.ndarray) -> dict:
  """name -> [rows, I] float32 inputs of that projection on `tokens` [B, T]."""
  from kvjax.model.decoder import forward_with_mtp  # kept lazy: model imports kvjax.model.layers

  probes = {}

  def probe(w, num_in, name):
    probes[name] = ActivationProbe(w, num_in)
    return probes[name]

  forward_with_mtp(_map_weights(params, probe), cfg, jnp.asarray(tokens, jnp.int32))
  rng = np.random.default_rng(0)
  inputs = {}
  for name, p in probes.items():
    x = np.concatenate(p.inputs)
    if x.shape[0] > _CALIBRATION_ROWS:
      x = x[rng.choice(x.shape[0], _CALIBRATION_ROWS, replace=False)]
    inputs[name] = jnp.asarray(x)
  return inputs


@functools.partial(jax.jit, static_argnames=("num_in", "bits", "group_size"))
def _awq_error(w: jax.Array, x: jax.Array, in_scale: jax.Array, *, num_in: int, bits: int,
               group_size: Optional[int]) -> jax.Array:
  """||x W - x W_q||^2 with W quantized under in_scale; x [rows, I]."""
  q = quantize_weight(w, num_in=num_in, bits=bits, group_size=group_size, in_scale=in_scale)
  matrix = w.reshape(x.shape[1], -1).astype(jnp.float32)  # [I, O]
  return jnp.sum((x @ (q.dequantize(jnp.float32).reshape(matrix.shape) - matrix)) ** 2)


def _awq_weight(w: jax.Array, x: jax.Array, num_in: int, bits: int,
                group_size: Optional[int]) -> QuantizedWeight:
  """Search alpha: s = mean|x|^alpha minimizing the output error on x [rows, I]."""
  mean_abs = jnp.maximum(jnp.mean(jnp.abs(x), axis=0), 1e-6)  # [I]
  candidates = []
  for alpha in AWQ_ALPHAS:  # alpha 0: s = 1, plain rounding
    s = mean_abs ** alpha
    s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))  # keep the scales centred around 1
    err = float(_awq_error(w, x, s, num_in=num_in, bits=bits, group_size=group_size))
    candidates.append((err, alpha, s))
  _, alpha, s = min(candidates, key=lambda c: c[:2])
  return quantize_weight(w, num_in=num_in, bits=bits, group_size=group_size,
                         in_scale=None if alpha == 0.0 else s)


def weight_scheme(weight_dtype: Optional[str]) -> Optional[str]:
  """load_checkpoint's `weight_dtype` -> a SCHEMES name ("int4" is int4-g32), None = float."""
  if weight_dtype is None:
    return None
  scheme = "int4-g32" if weight_dtype == "int4" else weight_dtype
  if scheme not in SCHEMES:
    raise ValueError(f"unknown weight_dtype {weight_dtype!r}; use None (float), 'int4' or one "
                     f"of {sorted(SCHEMES)}")
  return scheme


def quantize_params(params: Params, cfg: ModelConfig, scheme: str, *,
                    calibration_tokens: Optional[np.ndarray] = None) -> Params:
  """Params -> Params with QuantizedWeight projections; AWQ when calibration_tokens [B, T]."""
  if scheme not in SCHEMES:
    raise ValueError(f"unknown weight quantization scheme {scheme!r}; use one of "
                     f"{sorted(SCHEMES)}")
  if cfg.num_experts and calibration_tokens is not None:
    raise ValueError(f"AWQ calibration records dense projections' inputs; {cfg.name!r} has "
                     f"{cfg.num_experts} experts per MoE layer: quantize it without "
                     "calibration_tokens (plain rounding)")
  bits, group_size = SCHEMES[scheme]
  inputs = None if calibration_tokens is None else _calibrate(params, cfg, calibration_tokens)

  def quantize(w, num_in, name):
    if inputs is not None and name in inputs:
      return _awq_weight(w, inputs[name], num_in, bits, group_size)
    return quantize_weight(w, num_in=num_in, bits=bits, group_size=group_size)

  quantized = _map_weights(params, quantize)
  return quantized if params.lm_head is not None else quantized.replace(
      lm_head=tied_head(params.embed))


def tied_head(embed: jax.Array) -> QuantizedWeight:
  """The output projection [D, V] of a tied embedding [V, D] as int8 codes, one scale per
  vocabulary row (per output channel of the head)."""
  return quantize_weight(embed.T, num_in=1, bits=8, group_size=None)


def weight_bytes(params: Params) -> int:
  """Bytes of every parameter leaf (codes and scales of quantized weights included)."""
  leaves = jax.tree_util.tree_leaves(params)
  return sum(int(x.size) * x.dtype.itemsize for x in leaves)


def decode_step_weight_bytes(params: Params) -> int:
  """Weight bytes one plain decode step reads: the trunk but its embedding table, of
  which a step gathers only B rows (a tied head reads the whole table anyway); MTP
  draft modules are read only by speculative steps."""
  total = weight_bytes(params.replace(mtp=()))
  if params.lm_head is not None:
    total -= int(params.embed.size) * params.embed.dtype.itemsize
  return total
