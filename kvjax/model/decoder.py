"""The decoder as pure functions of (params, cache).

One block implementation serves every cache kind: each layer's registered kind
(kvjax/model/layer_kinds.py) computes its inputs and hands them to an `Attend`
record supplied by the caller (dense causal for the no-cache forward, or a
cache's methods for a StepBatch; kvjax/caches/): `attention(cache, index, q, k,
v)` for KV layouts, `linear(cache, index, inputs)` for recurrent ones.  The GQA
kind (MHA / GQA / MQA, with Qwen3.5's output gate and partial rope), the MLA
kind (latent attention) and the dense SwiGLU MLP kind are declared here; the
Gated DeltaNet kind is kvjax/model/hybrid.py.
Layers reach the cache by `ModelConfig.state_index` (a hybrid's KV rows count
only attention layers).  An MoE layer's MLP is kvjax/moe/block.py's.  The cache goes in
and comes out; nothing is mutated.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from kvjax.attention.dense import masked_attention, visibility_mask
from kvjax.attention.gated_delta import LinearInputs
from kvjax.attention.variants import layer_variant, variant_scores
from kvjax.model.config import ModelConfig
from kvjax.model.hybrid import stateless_mix
from kvjax.model.layer_kinds import LayerKind, MLPKind, layer_kind, mlp_kind, register_layer_kind, \
    register_mlp_kind, register_selector
from kvjax.model.layers import apply_rope, dense, matmul_precision, rms_norm, \
    rope_attention_factor, rope_inv_freq
from kvjax.model.params import AttentionParams, BlockParams, MLAParams, MTPParams, Params, \
    gqa_init, moe_init, swiglu_init
from kvjax.moe.block import moe_mlp, moe_mlp_routed
from kvjax.moe.routing import expert_token_counts

__all__ = ["rms_norm", "rope_inv_freq", "apply_rope", "decoder", "embed_tokens", "lm_logits",
           "mtp_block", "forward_hidden", "forward", "forward_with_mtp", "Attend",
           "mla_attention", "gqa_attention", "swiglu", "LORA_NORM_EPS", "GQA", "MLA", "SWIGLU",
           "MOE"]

# HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default, not rms_norm_eps.
LORA_NORM_EPS = 1e-6



@dataclasses.dataclass(frozen=True)
class Attend:
  """How a layer reaches its cache, one typed callable per cache layout.

  attention(cache, index, q [B, T, N, H], k [B, T, K, H], v [B, T, K, Hv], *, sinks [N]
    only where given) -> (cache, out [B, T, N, Hv]);
  linear(cache, index, inputs: LinearInputs) -> (cache, out [B, T, Nv, Hv] f32)
    (None where the caller has no recurrent state).
  `index` is the layer's row among its layout's cache rows (`ModelConfig.state_index`).
  """
  attention: Callable[[Any, int, jax.Array, jax.Array, jax.Array], tuple]
  linear: Optional[Callable[[Any, int, LinearInputs], tuple]] = None


def _inv_freq(cfg: ModelConfig, layer: int) -> jax.Array:
  """[rotary_dim / 2] rope frequencies of `layer` at its own base (partial rope rotates
  only the leading dims)."""
  theta = cfg.rope_theta_of_layer(layer)
  if theta != cfg.rope_theta:
    cfg = cfg.replace(rope_theta=theta)
  if cfg.rotary_dim == cfg.head_dim:
    return rope_inv_freq(cfg)
  return rope_inv_freq(cfg.replace(head_dim=cfg.rotary_dim, partial_rotary_factor=1.0))


def _rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float) -> jax.Array:
  """Rope on x's first 2 * len(inv_freq) dims; the rest pass through (partial rope)."""
  rotary = 2 * inv_freq.shape[0]
  if rotary == x.shape[-1]:
    return apply_rope(x, positions, inv_freq, scale)
  return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq, scale),
                          x[..., rotary:]], -1)


def gqa_attention(cfg: ModelConfig, a: AttentionParams, h: jax.Array, positions: jax.Array,
                   inv_freq: jax.Array, cache: Any, layer: int, attend: Attend):
  """MHA / GQA / MQA: h [B, T, D] -> (cache, out [B, T, D])."""
  q = dense("btd,dnh->btnh", h, a.wq)
  k = dense("btd,dkh->btkh", h, a.wk)
  v = dense("btd,dkh->btkh", h, a.wv)
  if a.bq is not None:
    q, k, v = q + a.bq, k + a.bk, v + a.bv
  if a.q_norm is not None:
    q = rms_norm(q, a.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k, a.k_norm, cfg.rms_norm_eps)
  scale = rope_attention_factor(cfg)
  q = _rope(q, positions, inv_freq, scale)
  k = _rope(k, positions, inv_freq, scale)
  with jax.named_scope(f"attention_{layer}"):
    cache, out = attend.attention(cache, cfg.state_index(layer), q, k, v)
  if a.wg is not None:  # Qwen3.5: each head's output scaled by its own sigmoid gate
    out = out * jax.nn.sigmoid(dense("btd,dnh->btnh", h, a.wg))
  out = dense("btnh,nhd->btd", out, a.wo)
  return cache, out if a.bo is None else out + a.bo


def mla_attention(cfg: ModelConfig, a: MLAParams, h: jax.Array, positions: jax.Array,
                  inv_freq: jax.Array, cache: Any, layer: int, attend: Attend):
  """Multi-head latent attention (DeepSeek-V2/V3): h [B, T, D] -> (cache, out [B, T, D]).

  Cached per token: the latent c = RMSNorm(x W_dkv) [R] and one rope key k_r
  [Hr] shared by every head.  Head n's key would be [c W_uk[n]; k_r] and its
  value c W_uv[n]; with the up-projections absorbed,
    q_n . k_n = (q_nope_n W_uk[n]^T) . c + q_rope_n . k_r
    out_n     = (sum_s p_s c_s) W_uv[n]
  so attention is MQA over one "kv head" of width R + Hr whose values are its
  first R dims: q [B, T, N, R + Hr], k [B, T, 1, R + Hr], v = k[..., :R] go to
  the same `attend` as GQA (kvjax/caches/mla.py stores k once).  Absorption is
  used in prefill too: more FLOPs there than expanding (R > Hn), one code path.
  Rope: HF DeepSeek rotates interleaved pairs; the loader (kvjax/weights/hf.py)
  permutes the rope columns of the q and kv_a projections to evens-then-odds,
  which makes kvjax's rotate-halves agree exactly.
  """
  hn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  if a.wq is not None:
    q = jnp.einsum("btd,dnh->btnh", h, a.wq)  # [B, T, N, Hn + Hr]
  else:
    q_low = rms_norm(h @ a.wq_a, a.q_norm, LORA_NORM_EPS)  # [B, T, Rq]
    q = jnp.tensordot(q_low, a.wq_b, axes=1)  # [B, T, N, Hn + Hr]
  scale = rope_attention_factor(cfg)
  q_nope, q_rope = q[..., :hn], apply_rope(q[..., hn:], positions, inv_freq, scale)
  kv = h @ a.wkv_a  # [B, T, R + Hr]
  latent = rms_norm(kv[..., :r], a.kv_norm, LORA_NORM_EPS)  # [B, T, R]
  k_rope = apply_rope(kv[:, :, None, r:], positions, inv_freq, scale)  # [B, T, 1, Hr]
  q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, a.wk_b)  # absorbed W_uk: [B, T, N, R]
  queries = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, N, R + Hr]
  entry = jnp.concatenate([latent[:, :, None], k_rope], axis=-1)  # [B, T, 1, R + Hr]
  with jax.named_scope(f"attention_{layer}"):
    cache, out = attend.attention(cache, layer, queries, entry, entry[..., :r])  # [B, T, N, R]
  out = jnp.einsum("btnr,rno->btno", out, a.wv_b)  # absorbed W_uv: [B, T, N, Hv]
  return cache, jnp.einsum("btno,nod->btd", out, a.wo)


_GATE_ACTIVATIONS = {"silu": jax.nn.silu,
                     "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def swiglu(cfg: ModelConfig, p: BlockParams, h: jax.Array) -> jax.Array:
  """The dense gated MLP: h [B, T, D] -> [B, T, D]; SwiGLU, or GeGLU with
  cfg.mlp_activation 'gelu_tanh' (Gemma)."""
  gate = _GATE_ACTIVATIONS[cfg.mlp_activation](dense("btd,df->btf", h, p.w_gate))
  return dense("btf,fd->btd", gate * dense("btd,df->btf", h, p.w_up), p.w_down)


GQA = register_layer_kind(LayerKind(
    name="gqa", init=gqa_init, cache="kv",
    step=gqa_attention))
MLA = register_layer_kind(LayerKind(
    name="mla", init=None, cache="latent",
    step=mla_attention))
SWIGLU = register_mlp_kind(MLPKind(name="swiglu", init=swiglu_init, apply=swiglu))
# Routed (+ shared) experts on the layers the config makes sparse (kvjax/moe/).
MOE = register_mlp_kind(MLPKind(name="moe", init=moe_init,
                                apply=lambda cfg, p, h: moe_mlp(cfg, p.moe, h),
                                routed=lambda cfg, p, h: moe_mlp_routed(cfg, p.moe, h)))
register_selector(lambda cfg, layer: "moe" if cfg.is_moe_layer(layer) else None,
                  registry="mlp")


def _block(cfg: ModelConfig, p: BlockParams, x: jax.Array, positions: jax.Array,
           inv_freq: jax.Array, cache: Any, layer: int, attend: Attend):
  """One pre-norm decoder block (its sublayer outputs normed too where it has post
  norms); x [B, T, D] -> (cache, x)."""
  return _routed_block(cfg, p, x, positions, inv_freq, cache, layer, attend, False)[:2]


def _routed_block(cfg: ModelConfig, p: BlockParams, x: jax.Array, positions: jax.Array,
                  inv_freq: jax.Array, cache: Any, layer: int, attend: Attend, routing: bool):
  """_block -> (cache, x, each token's experts [Bt, Ke] where `routing` and the layer
  routes, else None)."""
  h = rms_norm(x, p.attn_norm, cfg.rms_norm_eps)
  cache, out = layer_kind(cfg, layer).step(cfg, p.attn, h, positions, inv_freq, cache, layer,
                                           attend)
  if p.post_attn_norm is not None:
    out = rms_norm(out, p.post_attn_norm, cfg.rms_norm_eps)
  x = x + out
  h = rms_norm(x, p.mlp_norm, cfg.rms_norm_eps)
  kind, experts = mlp_kind(cfg, layer), None
  if routing and kind.routed is not None:
    out, experts = kind.routed(cfg, p, h)
  else:
    out = kind.apply(cfg, p, h)
  if p.post_mlp_norm is not None:
    out = rms_norm(out, p.post_mlp_norm, cfg.rms_norm_eps)
  return cache, x + out, experts


def decoder(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: Any, attend: Attend, valid: Optional[jax.Array] = None):
  """tokens, positions [B, T] -> (cache, hidden [B, T, D]) before the final norm.

  With `valid` [B, T] bool (False on padding): (cache, hidden, expert_tokens [L, Ne]
  int32), the valid tokens each layer routed to each expert (zero rows on layers
  without experts; Ne = 0 in a model without them).
  """
  x = embed_tokens(params, cfg, tokens)
  counts = []
  with matmul_precision(params.embed.dtype):
    for layer, block in enumerate(params.blocks):
      cache, x, experts = _routed_block(cfg, block, x, positions, _inv_freq(cfg, layer), cache,
                                        layer, attend, valid is not None)
      counts.append(jnp.zeros(cfg.num_experts, jnp.int32) if experts is None else
                    expert_token_counts(experts, valid.reshape(-1), cfg.num_experts))
  if valid is None:
    return cache, x
  return cache, x, jnp.stack(counts)


def embed_tokens(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
  """tokens [...] -> embeddings [..., D] (Gemma's times sqrt(D), rounded to their dtype
  first as transformers does)."""
  x = params.embed[tokens]
  if cfg.scale_embeddings:
    x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
  return x


def lm_logits(params: Params, cfg: ModelConfig, hidden: jax.Array,
              norm: Optional[jax.Array] = None) -> jax.Array:
  """hidden [..., D] -> float32 logits [..., V] through `norm` (default: final norm)."""
  h = rms_norm(hidden, params.final_norm if norm is None else norm, cfg.rms_norm_eps)
  with matmul_precision(params.embed.dtype):
    return dense("...d,dv->...v", h, params.head(), preferred_element_type=jnp.float32)


def mtp_block(params: Params, cfg: ModelConfig, depth: int, prev_hidden: jax.Array,
              next_tokens: jax.Array, positions: jax.Array, cache: Any, attend: Attend):
  """MTP module `depth` (0-based): combine h_{k-1} at t with embed(x_{t+k+1}).

  prev_hidden [B, T, D]; next_tokens, positions [B, T] -> (cache, hidden [B, T, D]).
  Its attention uses cache layer `num_layers + depth`.
  """
  m: MTPParams = params.mtp[depth]
  e = rms_norm(embed_tokens(params, cfg, next_tokens), m.embed_norm, cfg.rms_norm_eps)
  h = rms_norm(prev_hidden, m.hidden_norm, cfg.rms_norm_eps)
  with matmul_precision(params.embed.dtype):
    x = jnp.concatenate([e, h], axis=-1) @ m.proj
    return _block(cfg, m.block, x, positions, _inv_freq(cfg, cfg.num_layers + depth), cache,
                  cfg.num_layers + depth, attend)


def _dense_attend(cfg: ModelConfig, positions: jax.Array) -> Attend:
  """Causal self-attention among the T tokens themselves (no cache); linear layers
  run their rule over the T tokens from zero states."""
  valid = jnp.ones(positions.shape, bool)

  def attention(cache, layer, q, k, v, sinks=None):
    variant = layer_variant(cfg, layer)  # the model's window and attention= at once
    visible = visibility_mask(positions, positions, valid, variant)
    return cache, masked_attention(q, k, v, visible, sm_scale=cfg.attention_scale,
                                   sinks=sinks,
                                   score_mod=variant_scores(variant, positions, positions))

  return Attend(attention=attention, linear=lambda cache, index, inputs: (
      cache, stateless_mix(inputs)))


def forward_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
  """Full causal forward with no cache: tokens [B, T] -> hidden [B, T, D] (pre-norm)."""
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
  _, hidden = decoder(params, cfg, tokens, positions, None, _dense_attend(cfg, positions))
  return hidden


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
  """tokens int32 [B, T] -> float32 logits [B, T, V]."""
  return lm_logits(params, cfg, forward_hidden(params, cfg, tokens))


def forward_with_mtp(params: Params, cfg: ModelConfig, tokens: jax.Array):
  """Trunk logits plus every MTP module's logits, no cache (training and evaluation).

  Returns (logits [B, T, V], mtp_logits tuple of [B, T, V]): `mtp_logits[k-1][:, t]`
  predicts token t+k+1 from h_{k-1} at t and token t+k; the last k+1 rows have
  no target.
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape)
  attend = _dense_attend(cfg, positions)
  _, hidden = decoder(params, cfg, tokens, positions, None, attend)
  logits = lm_logits(params, cfg, hidden)
  mtp_logits = []
  for depth in range(len(params.mtp)):
    shifted = jnp.pad(tokens[:, depth + 1:], ((0, 0), (0, depth + 1)))  # x_{t+k}
    _, hidden = mtp_block(params, cfg, depth, hidden, shifted, positions, None, attend)
    mtp_logits.append(lm_logits(params, cfg, hidden, params.mtp[depth].out_norm))
  return logits, tuple(mtp_logits)
