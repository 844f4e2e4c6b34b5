"""The experts' gated activation: (gate, up) -> the input of the down projection.

  swiglu (Mixtral, Qwen3-MoE, DeepSeek-V3): silu(gate) * up.
  clamped_swiglu (gpt-oss): gate clamped to <= limit and up to [-limit, limit], then
      (up + 1) * gate * sigmoid(alpha * gate); the clamps keep rare huge activations
      from dominating, the + 1 lets up pass gate's signal through at zero.
One frozen record per config (`ExpertGLU.of`), so every expert path (kvjax/moe/grouped.py,
expert_parallel.py) applies the same rule and a jitted step hashes it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig

__all__ = ["ExpertGLU", "SWIGLU"]


@dataclasses.dataclass(frozen=True)
class ExpertGLU:
  limit: Optional[float] = None  # None: plain SwiGLU
  alpha: float = 1.0

  @staticmethod
  def of(cfg: ModelConfig) -> "ExpertGLU":
    if cfg.expert_activation == "clamped_swiglu":
      return ExpertGLU(limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)
    return SWIGLU

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """gate, up [..., Fe] -> [..., Fe]."""
    if self.limit is None:
      return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)


SWIGLU = ExpertGLU()
