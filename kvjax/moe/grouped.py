"""The routed experts' matmuls, two ways, picked by the step's static shape.

  switched (small decode batches, Ae = Bt Ke <= Ne assignments): per assignment a
      `jax.lax.switch` on its expert id whose branch e runs expert e's SwiGLU
      on the one token: only the chosen experts' weights are read (a batch-1
      step reads Ke experts, not Ne), each in place.
  grouped (prefill, big batches): the Ae (token, expert) assignments sorted by
      expert, `jax.lax.ragged_dot` over the stacked experts with the group sizes
      from the routing, the outputs unsorted back to (token, k) order and summed
      with the routing weights.  Every expert is read once however many tokens
      it serves.  (XLA:CPU runs ragged_dot as a masked dense dot, Ne x the
      flops; GPU and TPU have grouped kernels.)
Both compute sum_k w_k SwiGLU_{e_k}(x) for every token; dropless (no capacity).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.layers import dense
from kvjax.moe.params import ExpertParams

__all__ = ["swiglu", "switched_experts", "grouped_experts", "routed_experts"]


def swiglu(e: ExpertParams, x: jax.Array) -> jax.Array:
  """x [B, T, D] -> [B, T, D] through one expert (or the dense / shared MLP)."""
  gated = jax.nn.silu(dense("btd,df->btf", x, e.w_gate)) * dense("btd,df->btf", x, e.w_up)
  return dense("btf,fd->btd", gated, e.w_down)


def switched_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                     chosen: jax.Array) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D], one switch per assignment."""
  branches = [lambda row, e=e: swiglu(e, row) for e in experts]
  rows = []
  for a in range(x.shape[0]):
    row = x[a][None, None]  # [1, 1, D]
    out = [weights[a, j] * jax.lax.switch(chosen[a, j], branches, row)[0, 0].astype(jnp.float32)
           for j in range(chosen.shape[1])]
    rows.append(sum(out))
  return jnp.stack(rows).astype(x.dtype)


def _stacked(experts: tuple, name: str, dtype) -> jax.Array:
  """[Ne, ...] of every expert's `name` weight (quantized ones dequantized)."""
  leaves = [getattr(e, name) for e in experts]
  return jnp.stack([w.dequantize(dtype) if hasattr(w, "dequantize") else w for w in leaves])


def grouped_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                    chosen: jax.Array) -> jax.Array:
  """x [Bt, D], weights / chosen [Bt, Ke] -> [Bt, D] by sorted ragged_dot."""
  a, k = chosen.shape
  flat = chosen.reshape(-1)  # [Ae] expert of assignment (token a, slot j) at a k + j
  order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
  sizes = jnp.bincount(flat, length=len(experts)).astype(jnp.int32)  # [Ne]
  rows = x[order // k]  # [Ae, D]
  gate = jax.lax.ragged_dot(rows, _stacked(experts, "w_gate", x.dtype), sizes)
  up = jax.lax.ragged_dot(rows, _stacked(experts, "w_up", x.dtype), sizes)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, _stacked(experts, "w_down", x.dtype), sizes)
  out = jnp.zeros_like(out).at[order].set(out)  # back to assignment order
  combined = (out.reshape(a, k, -1).astype(jnp.float32) * weights[..., None]).sum(1)
  return combined.astype(x.dtype)


def routed_experts(experts: tuple, x: jax.Array, weights: jax.Array,
                   chosen: jax.Array) -> jax.Array:
  """The cheaper path for this static shape: switched while Bt Ke <= Ne (it then reads
  at most as many expert matrices as the grouped path's Ne), else grouped."""
  if chosen.size <= len(experts):
    return switched_experts(experts, x, weights, chosen)
  return grouped_experts(experts, x, weights, chosen)
