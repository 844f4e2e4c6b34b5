"""The Gated DeltaNet token mixer of hybrid models (Qwen3.5, Qwen3-Next).

A linear-attention layer projects h [B, T, D] to the conv input (q, k, v
channels), the output gate z, the write strength beta = sigmoid(h W_b) and the
log decay g = -exp(A_log) softplus(h W_a + dt_bias), then hands them to its
state keeper through the typed `attend.linear(cache, index, inputs)` callback
(kvjax/model/decoder.py `Attend`): inputs is a LinearInputs
(kvjax/attention/gated_delta.py) and `index` the layer's row among the linear
layers (`ModelConfig.state_index`).  The layer kind "gated_delta"
(kvjax/model/layer_kinds.py, cache layout "recurrent") is declared at the bottom.  A hybrid
cache (kvjax/caches/recurrent.py) runs
the rule on its per-slot conv and delta states; the no-cache forward runs it
from zero states (`stateless_mix`).  The output is RMS-normalized per value
head, gated by silu(z) and projected back to D.  The model's full-attention
layers (output gate, partial rope) stay in kvjax/model/decoder.py.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.attention.gated_delta import LinearInputs, gated_delta_mix, gated_rms_norm
from kvjax.model.config import ModelConfig
from kvjax.model.layer_kinds import LayerKind, register_layer_kind
from kvjax.model.layers import dense
from kvjax.model.params import GatedDeltaParams, gated_delta_init

__all__ = ["gated_delta_net", "stateless_mix", "linear_state_shapes", "GATED_DELTA"]


def linear_state_shapes(cfg: ModelConfig) -> tuple[tuple, tuple]:
  """Per-row state of one linear layer: (conv [Kc - 1, X], delta [Nv, Hk, Hv])."""
  channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
      cfg.linear_num_value_heads * cfg.linear_value_head_dim)
  return ((cfg.linear_conv_kernel - 1, channels),
          (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def stateless_mix(inputs: LinearInputs) -> jax.Array:
  """The rule over every column from zero states (a full sequence, no cache)
  -> o [B, T, Nv, Hv] f32."""
  b, t, channels = inputs.qkv.shape
  conv = jnp.zeros((b, inputs.conv_weight.shape[0] - 1, channels), inputs.qkv.dtype)
  delta = jnp.zeros((b, inputs.num_value_heads, inputs.key_head_dim, inputs.value_head_dim),
                    jnp.float32)
  out, _, _ = gated_delta_mix(inputs, conv, delta, jnp.full((b,), t, jnp.int32))
  return out


def gated_delta_net(cfg: ModelConfig, p: GatedDeltaParams, h: jax.Array, positions: jax.Array,
                    inv_freq: jax.Array, cache: Any, layer: int, attend):
  """h [B, T, D] -> (cache, out [B, T, D]) through attend.linear (kvjax/model/decoder.py `Attend`);
  positions and rope are unused (no rope here)."""
  del positions, inv_freq
  inputs = LinearInputs(
      qkv=dense("btd,dx->btx", h, p.w_qkv),
      g=-jnp.exp(p.a_log.astype(jnp.float32)) * jax.nn.softplus(
          dense("btd,di->bti", h, p.w_a).astype(jnp.float32) + p.dt_bias.astype(jnp.float32)),
      beta=jax.nn.sigmoid(dense("btd,di->bti", h, p.w_b).astype(jnp.float32)),
      conv_weight=p.conv, num_key_heads=cfg.linear_num_key_heads,
      key_head_dim=cfg.linear_key_head_dim, num_value_heads=cfg.linear_num_value_heads,
      value_head_dim=cfg.linear_value_head_dim, chunk=cfg.linear_chunk_size)
  with jax.named_scope(f"linear_attention_{layer}"):
    cache, out = attend.linear(cache, cfg.state_index(layer), inputs)  # [B, T, Nv, Hv]
  gate = dense("btd,dio->btio", h, p.w_z)
  out = gated_rms_norm(out.astype(h.dtype), gate, p.norm, cfg.rms_norm_eps)
  return cache, dense("btio,iod->btd", out, p.wo)


GATED_DELTA = register_layer_kind(LayerKind(
    name="gated_delta", init=gated_delta_init, step=gated_delta_net, cache="recurrent"))
