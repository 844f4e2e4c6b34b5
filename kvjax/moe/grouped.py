"""The routed experts' matmuls, two ways, picked by the step's static shape.

  switched (small decode batches, Ae = Bt Ke <= Ne assignments): per assignment a
      `jax.lax.switch` on its expert id whose branch e runs expert e's gated MLP
      on the one token: only the chosen experts' weights are read (a batch-1
      step reads Ke experts, not Ne), each in place.  On a CPU whose last-level
      cache holds a dense model of the same active size but not all Ne experts,
      those reads mostly come from DRAM: what bounds a small MoE's batch-1 step
      there (experiments/moe_bench.py's cache section).
  grouped (prefill, big batches): the Ae (token, expert) assignments sorted by
      expert, `jax.lax.ragged_dot` over the stacked experts with the group sizes
      from the routing (each row's biases gathered by its expert), the outputs
      unsorted back to (token, k) order and summed with the routing weights.
      Every expert is read once however many tokens it serves.  The ragged matmul
      is the config's record (kvjax/moe/grouped_matmul.py: jax.lax.ragged_dot, which
      XLA:CPU runs as a masked dense dot, Ne x the flops, or tokamax's GPU kernels).
Both compute sum_k w_k expert_{e_k}(x) for every token, `glu` the config's gated
activation (kvjax/moe/activation.py); dropless (no capacity).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.model.layers import dense
from kvjax.moe.activation import SWIGLU, ExpertGLU
from kvjax.moe.grouped_matmul import GROUPED_MATMULS, GroupedMatmul
from kvjax.moe.params import ExpertParams

__all__ = ["swiglu", "switched_experts", "grouped_experts", "routed_experts", "ragged_expert_mlp"]


def _plus(x: jax.Array, bias: Optional[jax.Array]) -> jax.Array:
  return x if bias is None else x + bias


def swiglu(e: ExpertParams, x: jax.Array, glu: ExpertGLU = SWIGLU) -> jax.Array:
  """x [B, T, D] -> [B, T, D] through one expert (or the dense / shared MLP)."""
  gated = glu(_plus(dense("btd,df->btf", x, e.w_gate), e.b_gate),
              _plus(dense("btd,df->btf", x, e.w_up), e.b_up))
  return _plus(dense("btf,fd->btd", gated, e.w_down), e.b_down)


def switched_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                     chosen: jax.Array, glu: ExpertGLU = SWIGLU) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D], one switch per assignment."""
  branches = [lambda row, e=e: swiglu(e, row, glu) for e in experts]
  rows = []
  for a in range(x.shape[0]):
    row = x[a][None, None]  # [1, 1, D]
    out = [weights[a, j] * jax.lax.switch(chosen[a, j], branches, row)[0, 0].astype(jnp.float32)
           for j in range(chosen.shape[1])]
    rows.append(sum(out))
  return jnp.stack(rows).astype(x.dtype)


def _stacked(experts: tuple, name: str, dtype) -> Optional[jax.Array]:
  """[Ne, ...] of every expert's `name` weight (quantized ones dequantized); None for an
  absent bias."""
  leaves = [getattr(e, name) for e in experts]
  if leaves[0] is None:
    return None
  return jnp.stack([w.dequantize(dtype) if hasattr(w, "dequantize") else w for w in leaves])


def ragged_expert_mlp(stacked: ExpertParams, rows: jax.Array, row_experts: jax.Array,
                      sizes: jax.Array, glu: ExpertGLU,
                      matmul: GroupedMatmul = GROUPED_MATMULS["xla"]) -> jax.Array:
  """rows [Ae, D] sorted by expert, row_experts [Ae] each row's (local) expert id, sizes
  [Ne] the group sizes -> [Ae, D] each row through its expert (rows past the groups:
  their bias only with "xla", for the caller to drop)."""
  bias = lambda b: None if b is None else b[jnp.clip(row_experts, 0, b.shape[0] - 1)]
  dot = matmul.ragged_dot
  gate = _plus(dot(rows, stacked.w_gate, sizes), bias(stacked.b_gate))
  up = _plus(dot(rows, stacked.w_up, sizes), bias(stacked.b_up))
  return _plus(dot(glu(gate, up), stacked.w_down, sizes), bias(stacked.b_down))


def grouped_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                    chosen: jax.Array, glu: ExpertGLU = SWIGLU,
                    matmul: GroupedMatmul = GROUPED_MATMULS["xla"]) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D] by sorted ragged_dot."""
  a, k = chosen.shape
  flat = chosen.reshape(-1)  # [Ae] expert of assignment (token a, slot j) at a k + j
  order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
  sizes = jnp.bincount(flat, length=len(experts)).astype(jnp.int32)  # [Ne]
  stacked = ExpertParams(**{name: _stacked(experts, name, x.dtype) for name in (
      "w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")})
  out = ragged_expert_mlp(stacked, x[order // k], flat[order], sizes, glu, matmul)  # [Ae, D]
  out = jnp.zeros_like(out).at[order].set(out)  # back to assignment order
  combined = (out.reshape(a, k, -1).astype(jnp.float32) * weights[..., None]).sum(1)
  return combined.astype(x.dtype)


def routed_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                   chosen: jax.Array, glu: ExpertGLU = SWIGLU,
                   matmul: GroupedMatmul = GROUPED_MATMULS["xla"]) -> jax.Array:
  """The cheaper path for this static shape: switched while Bt Ke <= Ne (it then reads
  at most as many expert matrices as the grouped path's Ne), else grouped over
  `matmul`."""
  if chosen.size <= len(experts):
    return switched_experts(experts, x, weights, chosen, glu)
  return grouped_experts(experts, x, weights, chosen, glu, matmul)
