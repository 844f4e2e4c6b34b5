"""HF Qwen3.5 (`qwen3_5`, `qwen3_5_text`) and dense Qwen3-Next (`qwen3_next`) checkpoints.

Hybrids: `layer_types` marks each layer "linear_attention" (Gated DeltaNet,
kvjax/model/hybrid.py) or "full_attention" (gated attention: q_proj packs each head's
query and its sigmoid output gate, q/k RMSNorm, rope on the first
partial_rotary_factor of each head).  Tensor names read, per layer
`{p}layers.{i}.` with p = "model." (`qwen3_5_text`, `qwen3_next`) or
"model.language_model." (`qwen3_5`, the multimodal release; `model.visual.*`
is not read):
  input_layernorm, post_attention_layernorm, mlp.{gate,up,down}_proj
  linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a} (Qwen3.5) or
  linear_attn.{in_proj_qkvz, in_proj_ba} (Qwen3-Next, grouped per key head,
  reordered here into Qwen3.5's layout), linear_attn.{conv1d, dt_bias, A_log,
  norm, out_proj}
  self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}
plus {p}embed_tokens, {p}norm, lm_head (unless tied) and, when config.json
declares `mtp_num_hidden_layers` and the tensors are there, the MTP head:
  mtp.fc (the [embed; hidden] -> D projection), mtp.pre_fc_norm_embedding,
  mtp.pre_fc_norm_hidden, mtp.layers.{j}.* (a full-attention decoder layer),
  mtp.norm
(HF transformers itself drops mtp.*; the names are the released checkpoints'.)

Every RMSNorm of these models except the DeltaNet's gated one is zero-centred
(it scales by 1 + w), so 1 is added to those weights once here.  MoE layers
(Qwen3-Next's default) raise a ValueError naming the fields that make them MoE.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from kvjax.model.config import ModelConfig
from kvjax.model.params import AttentionParams, BlockParams, GatedDeltaParams, MTPParams, Params

__all__ = ["QWEN3_5_MODEL_TYPES", "qwen3_5_config", "load_qwen3_5", "hf_eos_id"]


def hf_eos_id(hf: dict[str, Any]):
  """config.json's eos_token_id (an int or a list: its first) -> one id or None."""
  eos = hf.get("eos_token_id")
  if isinstance(eos, (list, tuple)):
    eos = eos[0] if eos else None
  return eos

QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
  """The language model's fields (the multimodal `qwen3_5` nests them in text_config)."""
  return {**hf, **hf["text_config"]} if hf.get("model_type") == "qwen3_5" else hf


def _check_dense(hf: dict[str, Any]) -> None:
  """Qwen3-Next layers are MoE unless listed in mlp_only_layers or off the sparse step."""
  experts = hf.get("num_experts") or 0
  step = hf.get("decoder_sparse_step") or 1
  dense_only = set(hf.get("mlp_only_layers") or [])
  moe = [i for i in range(hf["num_hidden_layers"])
         if experts > 0 and i not in dense_only and (i + 1) % step == 0]
  if moe:
    raise ValueError(
        f"{hf['model_type']} checkpoint has MoE layers {moe[:8]}{' ...' if len(moe) > 8 else ''} "
        f"(num_experts={experts}, decoder_sparse_step={step}, mlp_only_layers="
        f"{sorted(dense_only)}); kvjax loads only dense hybrids: num_experts=0 or every layer "
        "in mlp_only_layers")


def qwen3_5_config(hf: dict[str, Any], name: str) -> ModelConfig:
  """config.json of a Qwen3.5 / dense Qwen3-Next checkpoint -> ModelConfig."""
  text = _text_config(hf)
  if text.get("model_type") == "qwen3_next":
    _check_dense(text)
  rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if text.get("attention_bias"):
    raise ValueError(f"{text['model_type']} with attention_bias=true is unsupported (the "
                     "released checkpoints have none)")
  if rope_type != "default":
    raise ValueError(f"unsupported rope_type {rope_type!r} for {text['model_type']} "
                     "(supported: default)")
  # Multimodal rope (mrope_section) gives text tokens the same position in every
  # section, which is plain rope: the section layout does not matter here.
  partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
  num_layers = text["num_hidden_layers"]
  interval = text.get("full_attention_interval", 4)
  layer_types = text.get("layer_types") or [
      "full_attention" if (i + 1) % interval == 0 else "linear_attention"
      for i in range(num_layers)]
  eos = hf_eos_id(text)
  num_heads = text["num_attention_heads"]
  return ModelConfig(
      name=name, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
      intermediate_size=text["intermediate_size"], num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=text.get("num_key_value_heads") or num_heads,
      head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
      max_position_embeddings=text["max_position_embeddings"],
      rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
      rms_norm_eps=text.get("rms_norm_eps", 1e-6),
      tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
      qk_norm=True,
      mtp_num_hidden_layers=text.get("mtp_num_hidden_layers") or 0,
      layer_types=tuple(layer_types), linear_num_key_heads=text["linear_num_key_heads"],
      linear_num_value_heads=text["linear_num_value_heads"],
      linear_key_head_dim=text["linear_key_head_dim"],
      linear_value_head_dim=text["linear_value_head_dim"],
      linear_conv_kernel=text.get("linear_conv_kernel_dim", 4), attn_output_gate=True,
      partial_rotary_factor=float(partial), bos_token_id=text.get("bos_token_id"),
      eos_token_id=eos, pad_token_id=text.get("pad_token_id"))


def _gated_delta(cfg: ModelConfig, get, pre: str, grouped: bool) -> GatedDeltaParams:
  """linear_attn.* -> GatedDeltaParams; `grouped` is Qwen3-Next's per-key-head packing."""
  d, nk, hk = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_key_head_dim
  nv, hv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  if grouped:
    ratio = nv // nk  # value heads per key head: [q Hk | k Hk | v ratio*Hv | z ratio*Hv]
    qkvz = get(pre + "in_proj_qkvz.weight").T.reshape(d, nk, 2 * hk + 2 * ratio * hv)
    q, k = qkvz[..., :hk], qkvz[..., hk:2 * hk]
    v, z = qkvz[..., 2 * hk:2 * hk + ratio * hv], qkvz[..., 2 * hk + ratio * hv:]
    w_qkv = jnp.concatenate([x.reshape(d, -1) for x in (q, k, v)], axis=-1)
    ba = get(pre + "in_proj_ba.weight").T.reshape(d, nk, 2 * ratio)  # [b ratio | a ratio]
    w_b, w_a, w_z = ba[..., :ratio].reshape(d, nv), ba[..., ratio:].reshape(d, nv), z
  else:
    w_qkv = get(pre + "in_proj_qkv.weight").T
    w_z = get(pre + "in_proj_z.weight").T
    w_b, w_a = get(pre + "in_proj_b.weight").T, get(pre + "in_proj_a.weight").T
  return GatedDeltaParams(
      w_qkv=w_qkv, w_z=w_z.reshape(d, nv, hv), w_b=w_b, w_a=w_a,
      conv=get(pre + "conv1d.weight")[:, 0, :].T, dt_bias=get(pre + "dt_bias"),
      a_log=get(pre + "A_log"), norm=get(pre + "norm.weight"),
      wo=get(pre + "out_proj.weight").T.reshape(nv, hv, d))


def _block(cfg: ModelConfig, get, norm, pre: str, linear: bool, grouped: bool) -> BlockParams:
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if linear:
    mixer = _gated_delta(cfg, get, pre + "linear_attn.", grouped)
  else:
    a = pre + "self_attn."
    q_gate = get(a + "q_proj.weight").T.reshape(d, n, 2 * h)  # per head: [query | gate]
    mixer = AttentionParams(
        wq=q_gate[..., :h], wg=q_gate[..., h:],
        wk=get(a + "k_proj.weight").T.reshape(d, k, h),
        wv=get(a + "v_proj.weight").T.reshape(d, k, h),
        wo=get(a + "o_proj.weight").T.reshape(n, h, d),
        q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"))
  return BlockParams(
      attn_norm=norm(pre + "input_layernorm.weight"), attn=mixer,
      mlp_norm=norm(pre + "post_attention_layernorm.weight"),
      w_gate=get(pre + "mlp.gate_proj.weight").T, w_up=get(pre + "mlp.up_proj.weight").T,
      w_down=get(pre + "mlp.down_proj.weight").T)


def load_qwen3_5(cfg: ModelConfig, hf: dict[str, Any], get: Callable[[str], jnp.ndarray],
                 has: Callable[[str], bool]) -> tuple[ModelConfig, Params]:
  """-> (config, params) through `get(name)` (a tensor at the load dtype) and `has(name)`.

  A config declaring MTP layers whose tensors the checkpoint lacks (HF's
  save_pretrained drops mtp.*) comes back with mtp_num_hidden_layers=0.
  """
  model_type = hf.get("model_type")
  prefix = "model.language_model." if model_type == "qwen3_5" else "model."
  grouped = model_type == "qwen3_next"

  def norm(name):  # zero-centred RMSNorm: the scale is 1 + w
    w = get(name)
    return (w.astype(jnp.float32) + 1.0).astype(w.dtype)

  blocks = tuple(_block(cfg, get, norm, f"{prefix}layers.{i}.", cfg.is_linear_layer(i), grouped)
                 for i in range(cfg.num_layers))
  mtp = ()
  if cfg.mtp_num_hidden_layers and not has("mtp.fc.weight"):
    cfg = cfg.replace(mtp_num_hidden_layers=0)
  if cfg.mtp_num_hidden_layers:
    if cfg.mtp_num_hidden_layers != 1:
      raise ValueError(f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}: the mtp.* layout "
                       "read here has one fc and norm pair, so only 1 is supported")
    mtp = (MTPParams(
        embed_norm=norm("mtp.pre_fc_norm_embedding.weight"),
        hidden_norm=norm("mtp.pre_fc_norm_hidden.weight"), proj=get("mtp.fc.weight").T,
        block=_block(cfg, get, norm, "mtp.layers.0.", False, grouped),
        out_norm=norm("mtp.norm.weight")),)
  params = Params(
      embed=get(prefix + "embed_tokens.weight"), blocks=blocks,
      final_norm=norm(prefix + "norm.weight"),
      lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight").T, mtp=mtp)
  return cfg, params
