"""Expert parameter pytrees and their random initialization.

Each expert is its own `ExpertParams` leaf triple, not a slice of one stacked
[Ne, D, Fe] array: a small decode batch then reads a chosen expert's weights in
place (kvjax/moe/grouped.py `switched_experts`), where slicing one stacked array
by a traced index copies the slice first on XLA:CPU (3x the bytes).  The grouped
path stacks them for `jax.lax.ragged_dot`, and so does placement on a mesh with an
"expert" axis, once (kvjax/moe/expert_parallel.py).  Leaf names follow the dense
MLP's (`w_gate`, `w_up`, `w_down`), so tensor parallelism (kvjax/parallel/sharding.py)
splits each expert's width Fe over "model" and weight quantization finds them by name.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from kvjax.model.config import ModelConfig

__all__ = ["ExpertParams", "MoEParams", "init_moe"]


@struct.dataclass
class ExpertParams:
  """One gated expert: down(glu(x gate + b_gate, x up + b_up)) + b_down, glu the
  config's activation (kvjax/moe/activation.py); biases only where `moe_bias`."""
  w_gate: jax.Array  # [D, Fe]
  w_up: jax.Array  # [D, Fe]
  w_down: jax.Array  # [Fe, D]
  b_gate: Optional[jax.Array] = None  # [Fe]
  b_up: Optional[jax.Array] = None  # [Fe]
  b_down: Optional[jax.Array] = None  # [D]


@struct.dataclass
class MoEParams:
  router: jax.Array  # [D, Ne] router logits projection
  experts: tuple  # tuple[ExpertParams, ...], Ne routed experts
  router_bias: Optional[jax.Array] = None  # [Ne] added to the logits (gpt-oss)
  score_bias: Optional[jax.Array] = None  # [Ne] DeepSeek-V3 e_score_correction_bias
  shared: Optional[ExpertParams] = None  # always-on experts, one MLP of width Ns Fe
  # None: `experts` is the tuple.  Else the mesh whose "expert" axis splits `experts`, then
  # one ExpertParams of [Ne, ...] leaves (kvjax/moe/expert_parallel.py `stack_experts`).
  mesh: Optional[Mesh] = struct.field(pytree_node=False, default=None)


def _expert(key: jax.Array, d: int, width: int, dtype, std: float,
            bias: bool = False) -> ExpertParams:
  k_gate, k_up, k_down = jax.random.split(key, 3)
  normal = lambda kk, shape: (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)
  biases = {}
  if bias:  # own stream: bias-free experts draw as before
    kb_gate, kb_up, kb_down = jax.random.split(jax.random.fold_in(key, 3), 3)
    biases = dict(b_gate=normal(kb_gate, (width,)), b_up=normal(kb_up, (width,)),
                  b_down=normal(kb_down, (d,)))
  return ExpertParams(w_gate=normal(k_gate, (d, width)), w_up=normal(k_up, (d, width)),
                      w_down=normal(k_down, (width, d)), **biases)


def init_moe(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> MoEParams:
  """Random MoE layer (normal(0, std) weights; random choice, router and expert biases
  where the config has them)."""
  d, fe, ne = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
  k_router, k_experts, k_bias, k_shared = jax.random.split(key, 4)
  experts = tuple(_expert(kk, d, fe, dtype, std, cfg.moe_bias)
                  for kk in jax.random.split(k_experts, ne))
  shared = (_expert(k_shared, d, fe * cfg.num_shared_experts, dtype, std)
            if cfg.num_shared_experts else None)
  bias = (std * jax.random.normal(k_bias, (ne,), jnp.float32) if cfg.moe_score_bias else None)
  router_bias = (std * jax.random.normal(jax.random.fold_in(k_router, 1), (ne,))).astype(dtype) \
      if cfg.moe_bias else None
  return MoEParams(router=(std * jax.random.normal(k_router, (d, ne))).astype(dtype),
                   router_bias=router_bias, experts=experts, score_bias=bias, shared=shared)
