"""The MoE MLP of one decoder block: router, routed experts, shared experts.

h [B, T, D] -> router logits (float32, as HF computes DeepSeek-V3's; + gpt-oss's router
bias) -> the top-k experts and weights (kvjax/moe/routing.py) -> sum_k w_k expert_k(h),
each expert's gated activation the config's (kvjax/moe/activation.py), through the
path the shape picks (kvjax/moe/grouped.py; the grouped one's ragged matmul is the
config's `moe_grouped_matmul` record, kvjax/moe/grouped_matmul.py), or split over the
"expert" mesh axis (kvjax/moe/expert_parallel.py) -> + the shared experts' MLP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig
from kvjax.moe.activation import ExpertGLU
from kvjax.moe.expert_parallel import expert_parallel
from kvjax.moe.grouped import routed_experts, swiglu
from kvjax.moe.grouped_matmul import get_grouped_matmul
from kvjax.moe.params import MoEParams
from kvjax.moe.routing import route

__all__ = ["moe_mlp", "moe_mlp_routed"]


def moe_mlp(cfg: ModelConfig, p: MoEParams, h: jax.Array) -> jax.Array:
  """h [B, T, D] -> [B, T, D]."""
  return moe_mlp_routed(cfg, p, h)[0]


def moe_mlp_routed(cfg: ModelConfig, p: MoEParams, h: jax.Array) -> tuple:
  """h [B, T, D] -> ([B, T, D], each token's chosen experts [Bt, Ke] int32)."""
  x = h.reshape(-1, h.shape[-1])  # [Bt, D]: the B T tokens
  logits = jnp.matmul(x.astype(jnp.float32), p.router.astype(jnp.float32))  # [Bt, Ne]
  if p.router_bias is not None:
    logits = logits + p.router_bias.astype(jnp.float32)
  weights, chosen = route(cfg, logits, p.score_bias)
  glu = ExpertGLU.of(cfg)
  if p.mesh is not None:  # stacked over the "expert" mesh axis
    out = expert_parallel(p, x, weights, chosen, glu).reshape(h.shape)
  else:
    out = routed_experts(p.experts, x, weights, chosen, glu,
                         get_grouped_matmul(cfg.moe_grouped_matmul)).reshape(h.shape)
  if p.shared is not None:
    out = out + swiglu(p.shared, h)
  return out, chosen
