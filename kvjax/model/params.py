"""Parameter pytrees and random initialization.

Weights are stored input-major so every projection is `x @ w` (einsum
'btd,dnh->btnh'); HF's torch layout ([out, in]) is transposed once at load time
(kvjax/weights/hf.py).  Optional parts are `None` leaves, so one pytree type
serves Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.model.config import ModelConfig
from kvjax.model.layer_kinds import layer_kind, mlp_kind
from kvjax.moe.params import MoEParams, init_moe

__all__ = ["AttentionParams", "GatedDeltaParams", "MLAParams", "BlockParams", "MTPParams",
           "Params", "init_params", "count_params", "gqa_init", "gated_delta_init",
           "swiglu_init", "moe_init"]


@struct.dataclass
class AttentionParams:
  wq: jax.Array  # [D, N, H]
  wk: jax.Array  # [D, K, H]
  wv: jax.Array  # [D, K, H]
  wo: jax.Array  # [N, H, D]
  bq: Optional[jax.Array] = None  # [N, H]  (Qwen2)
  bk: Optional[jax.Array] = None  # [K, H]
  bv: Optional[jax.Array] = None  # [K, H]
  q_norm: Optional[jax.Array] = None  # [H]  (Qwen3)
  k_norm: Optional[jax.Array] = None  # [H]
  wg: Optional[jax.Array] = None  # [D, N, H] sigmoid output gate (Qwen3.5 gated attention)
  bo: Optional[jax.Array] = None  # [D] o projection bias (gpt-oss)


@struct.dataclass
class GatedDeltaParams:
  """One Gated DeltaNet layer (Qwen3.5 / Qwen3-Next; kvjax/model/hybrid.py, the rule in
  kvjax/attention/gated_delta.py).  Nk / Nv key / value heads, Hk / Hv their dims,
  X = 2 Nk Hk + Nv Hv conv channels, Kc the conv width."""
  w_qkv: jax.Array  # [D, X] q, k, v channels before the conv
  w_z: jax.Array  # [D, Nv, Hv] output gate
  w_b: jax.Array  # [D, Nv] write strength logits (beta = sigmoid)
  w_a: jax.Array  # [D, Nv] decay logits
  conv: jax.Array  # [Kc, X] depthwise causal conv
  dt_bias: jax.Array  # [Nv]
  a_log: jax.Array  # [Nv] log decay rate: g = -exp(a_log) softplus(a + dt_bias)
  norm: jax.Array  # [Hv] gated RMSNorm weight
  wo: jax.Array  # [Nv, Hv, D]


@struct.dataclass
class MLAParams:
  """Multi-head latent attention (DeepSeek-V2/V3; kvjax/model/decoder.py mla_attention).

  R = kv_lora_rank, Rq = q_lora_rank, Hn/Hr/Hv = qk_nope/qk_rope/v head dims.
  The queries come from `wq` or, with a q low-rank path, `wq_b(norm(wq_a))`.
  """
  wkv_a: jax.Array  # [D, R + Hr] latent and the shared (head-less) rope key
  kv_norm: jax.Array  # [R]
  wk_b: jax.Array  # [R, N, Hn] latent -> nope key (absorbed into the query)
  wv_b: jax.Array  # [R, N, Hv] latent -> value (absorbed into the output)
  wo: jax.Array  # [N, Hv, D]
  wq: Optional[jax.Array] = None  # [D, N, Hn + Hr]  (q_lora_rank None)
  wq_a: Optional[jax.Array] = None  # [D, Rq]
  q_norm: Optional[jax.Array] = None  # [Rq]
  wq_b: Optional[jax.Array] = None  # [Rq, N, Hn + Hr]


@struct.dataclass
class BlockParams:
  attn_norm: jax.Array  # [D]
  attn: AttentionParams  # the layer kind's params (kvjax/model/layer_kinds.py): MLAParams for
  #                       "mla", GatedDeltaParams for "gated_delta", ...
  mlp_norm: jax.Array  # [D]
  w_gate: Optional[jax.Array] = None  # [D, F]  (None on MoE layers)
  w_up: Optional[jax.Array] = None  # [D, F]
  w_down: Optional[jax.Array] = None  # [F, D]
  moe: Optional[MoEParams] = None  # routed (+ shared) experts on config.is_moe_layer layers
  post_attn_norm: Optional[jax.Array] = None  # [D] on the attention output (post_norms)
  post_mlp_norm: Optional[jax.Array] = None  # [D] on the MLP output


@struct.dataclass
class MTPParams:
  """One DeepSeek-V3 MTP module: h_k = Block(proj([norm(embed(x_{t+k})); norm(h_{k-1})]))."""
  embed_norm: jax.Array  # [D]
  hidden_norm: jax.Array  # [D]
  proj: jax.Array  # [2D, D]
  block: BlockParams
  out_norm: jax.Array  # [D]  (the head itself is shared with the trunk)


@struct.dataclass
class Params:
  embed: jax.Array  # [V, D]
  blocks: tuple  # tuple[BlockParams, ...], one per layer
  final_norm: jax.Array  # [D]
  lm_head: Optional[jax.Array] = None  # [D, V]; None when tied to embed
  mtp: tuple = ()  # tuple[MTPParams, ...], config.mtp_num_hidden_layers of them

  def head(self) -> jax.Array:
    """Output projection [D, V] (the transposed embedding when tied)."""
    return self.embed.T if self.lm_head is None else self.lm_head


def _block_keys(key: jax.Array) -> jax.Array:
  """A block key's 10 streams: the token mixer draws from 0-6, the MLP from 7-9 (fixed
  so seeded models, and the golden runs built on them, stay bit-identical)."""
  return jax.random.split(key, 10)


def gated_delta_init(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> GatedDeltaParams:
  """The Gated DeltaNet layer kind's params (kvjax/model/hybrid.py GATED_DELTA) from the
  block key."""
  key = _block_keys(key)[0]
  d, nv, hv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
  channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + nv * hv
  keys = jax.random.split(key, 7)
  normal = lambda kk, shape: (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)
  # HF's init: unit dt_bias, decay rates A uniform in [0.01, 16) (kept away from log 0).
  rates = jax.random.uniform(keys[6], (nv,), jnp.float32, 0.01, 16.0)
  return GatedDeltaParams(
      w_qkv=normal(keys[0], (d, channels)), w_z=normal(keys[1], (d, nv, hv)),
      w_b=normal(keys[2], (d, nv)), w_a=normal(keys[3], (d, nv)),
      conv=normal(keys[4], (cfg.linear_conv_kernel, channels)),
      dt_bias=jnp.ones((nv,), dtype), a_log=jnp.log(rates).astype(dtype),
      norm=jnp.ones((hv,), dtype), wo=normal(keys[5], (nv, hv, d)))


def gqa_init(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> AttentionParams:
  """The GQA layer kind's params (kvjax/model/decoder.py GQA_ATTENTION) from the block key."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  keys = _block_keys(key)
  normal = lambda kk, shape: (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)
  bias = cfg.attention_bias
  return AttentionParams(
      wq=normal(keys[0], (d, n, h)), wk=normal(keys[1], (d, k, h)),
      wv=normal(keys[2], (d, k, h)), wo=normal(keys[3], (n, h, d)),
      bq=normal(keys[4], (n, h)) if bias else None,
      bk=normal(keys[5], (k, h)) if bias else None,
      bv=normal(keys[6], (k, h)) if bias else None,
      q_norm=jnp.ones((h,), dtype) if cfg.qk_norm else None,
      k_norm=jnp.ones((h,), dtype) if cfg.qk_norm else None,
      wg=normal(jax.random.fold_in(key, 10), (d, n, h)) if cfg.attn_output_gate else None,
      bo=normal(jax.random.fold_in(key, 12), (d,)) if cfg.attention_out_bias else None)


def swiglu_init(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> dict:
  """The dense SwiGLU MLP kind's BlockParams fields (kvjax/model/decoder.py SWIGLU) from the
  block key."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  keys = _block_keys(key)
  normal = lambda kk, shape: (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)
  return dict(w_gate=normal(keys[7], (d, f)), w_up=normal(keys[8], (d, f)),
              w_down=normal(keys[9], (f, d)))


def moe_init(cfg: ModelConfig, key: jax.Array, dtype, std: float) -> dict:
  """The MoE MLP kind's BlockParams fields (kvjax/model/decoder.py MOE) from the block key."""
  return dict(moe=init_moe(cfg, _block_keys(key)[7], dtype, std))


def _block_init(cfg: ModelConfig, key: jax.Array, dtype, std: float,
                layer: int = 0) -> BlockParams:
  """Norms, then the layer's token mixer and MLP from their registered kinds."""
  kind = layer_kind(cfg, layer)
  if kind.init is None:
    raise NotImplementedError(f"layer kind {kind.name!r} has no random init (load weights)")
  d = cfg.hidden_size
  post = jnp.ones((d,), dtype) if cfg.post_norms else None
  return BlockParams(
      attn_norm=jnp.ones((d,), dtype), attn=kind.init(cfg, key, dtype, std),
      mlp_norm=jnp.ones((d,), dtype), post_attn_norm=post, post_mlp_norm=post,
      **mlp_kind(cfg, layer).init(cfg, key, dtype, std))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32,
                std: float = 0.02) -> Params:
  """Random init (HF's normal(0, initializer_range) convention, unit norms)."""
  k_embed, k_head, k_blocks, k_mtp = jax.random.split(key, 4)
  d = cfg.hidden_size
  blocks = tuple(_block_init(cfg, kk, dtype, std, layer)
                 for layer, kk in enumerate(jax.random.split(k_blocks, cfg.num_layers)))
  mtp = []
  for kk in jax.random.split(k_mtp, cfg.mtp_num_hidden_layers):
    k_proj, k_block = jax.random.split(kk)
    mtp.append(MTPParams(
        embed_norm=jnp.ones((d,), dtype), hidden_norm=jnp.ones((d,), dtype),
        proj=(std * jax.random.normal(k_proj, (2 * d, d))).astype(dtype),
        block=_block_init(cfg, k_block, dtype, std, cfg.num_layers),
        out_norm=jnp.ones((d,), dtype)))
  return Params(
      embed=(std * jax.random.normal(k_embed, (cfg.vocab_size, d))).astype(dtype),
      blocks=blocks, final_norm=jnp.ones((d,), dtype),
      lm_head=None if cfg.tie_word_embeddings else
      (std * jax.random.normal(k_head, (d, cfg.vocab_size))).astype(dtype),
      mtp=tuple(mtp))


def count_params(params: Params) -> int:
  return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
