"""Function-preserving growth: a larger model that computes exactly what a smaller one does.

`grow(cfg, params, ...)` returns a model with a wider residual stream, more kv heads
(each with its group of q heads), a wider MLP and more layers whose logits equal the
original's (float rounding aside), while every step does the larger model's work:
its weights are read, its matmuls and its K/V pages are the larger model's.  Two uses:
  * serving experiments that need a larger model's costs with a trained model's
    predictions (MTP acceptance, greedy text): experiments/serve_bench.py's `:grown`
    config, speculation on a model whose steps cost what a 123M-parameter model's do;
  * a starting point for training a larger model (Net2Net, Chen et al. 2016): weights
    that read new features are random and weights that write them are zero, so every
    new weight gets a gradient and training starts from the smaller model's loss.
How the function is kept:
  * residual stream D -> D': every weight that writes it (embed, wo, w_down, the MTP
    projections) is zero into the new dims, so they stay exactly 0;
  * RMSNorm over D' of a vector with D' - D zeros sees mean(x^2) shrunk by D / D': the
    grown config's eps is eps D / D' and every D-wide norm weight is scaled by
    sqrt(D / D'), which cancels the shrink exactly;
  * new kv heads come with N / K new q heads each (the GQA grouping is kept, new heads
    after the old ones); their wo rows are zero;
  * new MLP units have zero w_down rows; new layers are whole blocks with zero wo and
    w_down (identity on the residual), spread evenly between the original layers.
Supported: plain GQA decoders.  Refused, naming the field: per-head q/k norms (their eps
is the shared rms_norm_eps, which growth rescales), MLA, hybrid layers, per-layer
windows, experts and gated attention.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax.model.config import ModelConfig
from kvjax.model.params import AttentionParams, BlockParams, MTPParams, Params

__all__ = ["grow"]


def _check(cfg: ModelConfig, hidden_size, intermediate_size, num_kv_heads, num_layers):
  unsupported = {"attention_type": cfg.attention_type != "gqa", "qk_norm": cfg.qk_norm,
                 "layer_types": cfg.layer_types is not None,
                 "layer_windows": cfg.layer_windows is not None,
                 "num_experts": cfg.num_experts > 0, "attn_output_gate": cfg.attn_output_gate,
                 "post_norms": cfg.post_norms}
  bad = [name for name, is_bad in unsupported.items() if is_bad]
  if bad:
    raise ValueError(f"grow supports plain GQA decoders; {cfg.name} has "
                     + ", ".join(f"{name}={getattr(cfg, name)!r}" for name in bad))
  for name, new in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                    ("num_kv_heads", num_kv_heads), ("num_layers", num_layers)):
    old = getattr(cfg, name)
    if not isinstance(new, int) or new < old:
      raise ValueError(f"grow: {name} must be an int >= the model's {old}, got {new!r}")


class _Filler:
  """New entries of grown weights: random (weights that read) or zero (that write)."""

  def __init__(self, key: jax.Array, std: float, dtype):
    self._key, self.std, self.dtype = key, std, dtype

  def random(self, shape) -> jax.Array:
    self._key, key = jax.random.split(self._key)
    return (self.std * jax.random.normal(key, shape, jnp.float32)).astype(self.dtype)

  def zeros(self, shape) -> jax.Array:
    return jnp.zeros(shape, self.dtype)

  def norm(self, old: jax.Array, d: int, scale: float) -> jax.Array:
    """A D-wide norm weight grown to d: scaled by `scale`, new entries `scale` too."""
    new = jnp.full((d,), scale, self.dtype)
    return new.at[:old.shape[0]].set((old * scale).astype(self.dtype))

  def place(self, old: jax.Array, shape, read: bool) -> jax.Array:
    """`old` in the leading corner of a new array of `shape` filled by read/write rule."""
    new = self.random(shape) if read else self.zeros(shape)
    return new.at[tuple(slice(0, n) for n in old.shape)].set(old.astype(self.dtype))


def _grow_attention(a: AttentionParams, fill: _Filler, d, n, k) -> AttentionParams:
  h = a.wq.shape[-1]
  grown_bias = lambda b, heads: None if b is None else fill.place(b, (heads, h), read=False)
  return AttentionParams(
      wq=fill.place(a.wq, (d, n, h), read=True), wk=fill.place(a.wk, (d, k, h), read=True),
      wv=fill.place(a.wv, (d, k, h), read=True), wo=fill.place(a.wo, (n, h, d), read=False),
      bq=grown_bias(a.bq, n), bk=grown_bias(a.bk, k), bv=grown_bias(a.bv, k))


def _grow_block(b: BlockParams, fill: _Filler, d, f, n, k, norm_scale) -> BlockParams:
  return BlockParams(
      attn_norm=fill.norm(b.attn_norm, d, norm_scale),
      attn=_grow_attention(b.attn, fill, d, n, k),
      mlp_norm=fill.norm(b.mlp_norm, d, norm_scale),
      w_gate=fill.place(b.w_gate, (d, f), read=True), w_up=fill.place(b.w_up, (d, f), read=True),
      w_down=fill.place(b.w_down, (f, d), read=False))


def _identity_block(fill: _Filler, d, f, n, k, h, bias: bool, norm_scale) -> BlockParams:
  """A random block whose outputs (wo, w_down) are zero: the residual passes unchanged."""
  biases = dict(bq=fill.zeros((n, h)), bk=fill.zeros((k, h)), bv=fill.zeros((k, h))) if bias \
      else {}
  return BlockParams(
      attn_norm=jnp.full((d,), norm_scale, fill.dtype),
      attn=AttentionParams(wq=fill.random((d, n, h)), wk=fill.random((d, k, h)),
                           wv=fill.random((d, k, h)), wo=fill.zeros((n, h, d)), **biases),
      mlp_norm=jnp.full((d,), norm_scale, fill.dtype), w_gate=fill.random((d, f)),
      w_up=fill.random((d, f)), w_down=fill.zeros((f, d)))


def _grow_mtp(m: MTPParams, fill: _Filler, d, f, n, k, norm_scale) -> MTPParams:
  d_old = m.proj.shape[1]
  # proj reads [norm(embed); norm(hidden)] (2D' wide) and writes the residual (D').
  reads = fill.random((2 * d, d_old))
  reads = reads.at[:d_old].set(m.proj[:d_old].astype(fill.dtype))
  reads = reads.at[d:d + d_old].set(m.proj[d_old:].astype(fill.dtype))
  return MTPParams(
      embed_norm=fill.norm(m.embed_norm, d, norm_scale),
      hidden_norm=fill.norm(m.hidden_norm, d, norm_scale),
      proj=fill.place(reads, (2 * d, d), read=False),
      block=_grow_block(m.block, fill, d, f, n, k, norm_scale),
      out_norm=fill.norm(m.out_norm, d, norm_scale))


def _original_positions(num_layers: int, grown_layers: int) -> list:
  """Where the original layers sit among the grown model's (evenly spread, in order)."""
  return [i * grown_layers // num_layers for i in range(num_layers)]


def grow(cfg: ModelConfig, params: Params, *, hidden_size: int, intermediate_size: int,
         num_kv_heads: int, num_layers: int, key: jax.Array, std: float = 0.02,
         name: str | None = None) -> tuple[ModelConfig, Params]:
  """(config, params) of the grown model (module doc); q heads grow with the kv heads."""
  _check(cfg, hidden_size, intermediate_size, num_kv_heads, num_layers)
  d, f, k = hidden_size, intermediate_size, num_kv_heads
  n = k * (cfg.num_heads // cfg.num_kv_heads)
  ratio = cfg.hidden_size / d
  norm_scale = math.sqrt(ratio)
  dtype = params.embed.dtype
  fill = _Filler(key, std, dtype)
  grown_cfg = cfg.replace(
      name=name or f"{cfg.name}-grown-{d}x{num_layers}", hidden_size=d,
      intermediate_size=f, num_heads=n, num_kv_heads=k, num_layers=num_layers,
      rms_norm_eps=cfg.rms_norm_eps * ratio)
  grown = {pos: _grow_block(b, fill, d, f, n, k, norm_scale) for pos, b in zip(
      _original_positions(cfg.num_layers, num_layers), params.blocks)}
  blocks = tuple(grown[i] if i in grown else
                 _identity_block(fill, d, f, n, k, cfg.head_dim, cfg.attention_bias, norm_scale)
                 for i in range(num_layers))
  return grown_cfg, Params(
      embed=fill.place(params.embed, (cfg.vocab_size, d), read=False),
      blocks=blocks,
      final_norm=fill.norm(params.final_norm, d, norm_scale),
      lm_head=None if params.lm_head is None else
      fill.place(params.lm_head, (d, cfg.vocab_size), read=True),
      mtp=tuple(_grow_mtp(m, fill, d, f, n, k, norm_scale) for m in params.mtp))
