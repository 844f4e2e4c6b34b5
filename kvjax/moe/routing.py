"""Router logits -> each token's top-k experts and their weights, as each family routes.

  softmax (Mixtral, Qwen3-MoE): p = softmax(logits) over every expert, the k
      largest p (ties broken as torch.topk breaks them: kvjax/moe/topk.py); Qwen's
      `norm_topk_prob` (always on for Mixtral) divides them by their sum.
  softmax after top-k (gpt-oss): the k largest logits, softmax over those k.
  sigmoid (DeepSeek-V3): s = sigmoid(logits); the choice ranks s + bias (the
      e_score_correction_bias, which steers load and never enters the weights),
      restricted to the `moe_topk_groups` best of `moe_num_groups` expert groups
      (a group's score: the sum of its two best choice scores); the weights are
      the chosen s, renormalized (+1e-20) under `norm_topk_prob`.
Every weight is then multiplied by `routed_scaling_factor`.  Float32 throughout.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig
from kvjax.moe.topk import top_k_experts

__all__ = ["expert_token_counts", "route"]


def _limit_groups(cfg: ModelConfig, choice: jax.Array) -> jax.Array:
  """choice [Bt, Ne] with every expert outside the best groups set to -inf."""
  groups = cfg.moe_num_groups
  per_group = choice.reshape(*choice.shape[:-1], groups, -1)  # [Bt, groups, Ne / groups]
  group_scores = jax.lax.top_k(per_group, 2)[0].sum(-1)  # [Bt, groups]
  best = top_k_experts(group_scores, cfg.moe_topk_groups)  # [Bt, topk_groups]
  kept = (best[..., None] == jnp.arange(groups)).any(-2)  # [Bt, groups]
  kept = jnp.broadcast_to(kept[..., None], per_group.shape).reshape(choice.shape)
  return jnp.where(kept, choice, -jnp.inf)


def route(cfg: ModelConfig, logits: jax.Array, score_bias: Optional[jax.Array] = None):
  """logits [Bt, Ne] -> (weights [Bt, Ke] float32, experts [Bt, Ke] int32)."""
  logits = logits.astype(jnp.float32)
  k = cfg.num_experts_per_tok
  if cfg.moe_scoring == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.astype(jnp.float32)
    if cfg.moe_num_groups > 1:
      choice = _limit_groups(cfg, choice)
    experts = top_k_experts(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    eps = 1e-20
  elif cfg.moe_softmax_after_topk:
    experts = top_k_experts(logits, k)
    weights, eps = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1), 0.0
  else:
    probs = jax.nn.softmax(logits, axis=-1)
    experts = top_k_experts(probs, k)
    weights, eps = jnp.take_along_axis(probs, experts, axis=-1), 0.0
  if cfg.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + eps)
  return weights * cfg.routed_scaling_factor, experts


def expert_token_counts(experts: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
  """experts [Bt, Ke] (route's), valid [Bt] bool (padding tokens False) -> [Ne] int32:
  the real tokens routed to each expert (they sum to valid tokens x Ke)."""
  hits = jnp.broadcast_to(valid[:, None], experts.shape).astype(jnp.int32)
  return jnp.zeros(num_experts, jnp.int32).at[experts].add(hits)
