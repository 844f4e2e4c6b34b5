"""The "gqa_sinks" layer kind: GQA attention with gpt-oss's learned per-head sinks.

Each query head n owns one logit s_n that joins every softmax denominator,
  p_j = exp(x_j) / (exp(s_n) + sum_i exp(x_i)),
a key every query sees whose value is zero, so a head can attend to "nothing".
Everything else is the GQA kind (kvjax/model/decoder.py `gqa_attention`, its KV cache
layout and Megatron placement: sinks split by q head like wq); the sinks reach
the softmax as the `sinks` keyword of `Attend.attention`
(kvjax/attention/dense.py `grouped_attention`).  A config selects the kind by
its name: `with_learned_sinks(cfg)`.  Walkthrough: docs/EXTENDING.md.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.model.config import ModelConfig
from kvjax.model.decoder import gqa_attention
from kvjax.model.layer_kinds import LayerKind, register_layer_kind, register_selector
from kvjax.model.params import AttentionParams, gqa_init

__all__ = ["SinkAttentionParams", "sink_attention", "with_learned_sinks", "LEARNED_SINKS",
           "NAME_SUFFIX"]

NAME_SUFFIX = "+sinks"


@struct.dataclass
class SinkAttentionParams:
  attn: AttentionParams
  sinks: jax.Array  # [N] one softmax-denominator logit per q head


def _init(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> SinkAttentionParams:
  sinks = std * jax.random.normal(jax.random.fold_in(key, 11), (cfg.num_heads,), jnp.float32)
  return SinkAttentionParams(attn=gqa_init(cfg, key, dtype, std), sinks=sinks.astype(dtype))


def sink_attention(cfg: ModelConfig, p: SinkAttentionParams, h: jax.Array, positions: jax.Array,
                   inv_freq: jax.Array, cache, layer: int, attend):
  """h [B, T, D] -> (cache, out [B, T, D]): GQA whose attention call carries the sinks."""
  inner = attend.attention
  with_sinks = dataclasses.replace(
      attend, attention=lambda c, index, q, k, v: inner(c, index, q, k, v, sinks=p.sinks))
  return gqa_attention(cfg, p.attn, h, positions, inv_freq, cache, layer, with_sinks)


def with_learned_sinks(cfg: ModelConfig) -> ModelConfig:
  """cfg whose attention layers are the "gqa_sinks" kind."""
  return cfg if cfg.name.endswith(NAME_SUFFIX) else cfg.replace(name=cfg.name + NAME_SUFFIX)


def _select(cfg: ModelConfig, layer: int):
  if cfg.name.endswith(NAME_SUFFIX) and not cfg.is_linear_layer(layer) \
      and cfg.attention_type == "gqa":
    return "gqa_sinks"
  return None


LEARNED_SINKS = register_layer_kind(LayerKind(
    name="gqa_sinks", init=_init, step=sink_attention, cache="kv"))
register_selector(_select)
