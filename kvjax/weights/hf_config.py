"""HF config.json -> kvjax ModelConfig, reading no tensor.

Supported `model_type`s: llama (incl. Llama-3.1 rope scaling), mistral (sliding
window), qwen2 (qkv bias, optional per-layer sliding window), qwen3 (q/k norm),
deepseek_v2 / deepseek_v3 (MLA; V3's MoE layers), mixtral and qwen3_moe
(kvjax/weights/hf_moe.py), gpt_oss (learned sinks, alternating sliding / full layers,
YaRN rope), qwen3_5 / qwen3_5_text / dense qwen3_next hybrids
(kvjax/weights/hf_qwen3_5.py).  Errors name the file and the field.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from kvjax.model.config import ModelConfig, RopeScaling, YarnScaling
from kvjax.model.learned_sinks import with_learned_sinks
from kvjax.weights.config_checks import check_hf_fields
from kvjax.weights.hf_moe import MOE_MODEL_TYPES, moe_config
from kvjax.weights.hf_qwen3_5 import QWEN3_5_MODEL_TYPES, hf_eos_id, qwen3_5_config

__all__ = ["SUPPORTED_MODEL_TYPES", "is_hf_checkpoint", "read_hf_config", "config_from_hf"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v2",
                         "deepseek_v3") + MOE_MODEL_TYPES + QWEN3_5_MODEL_TYPES
_DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def is_hf_checkpoint(path: str) -> bool:
  """An HF directory's config.json names its `model_type` (kvjax's own never does)."""
  config = os.path.join(path, "config.json")
  if not os.path.isfile(config):
    return False
  with open(config) as f:
    try:
      loaded = json.load(f)
    except ValueError as error:
      raise ValueError(f"{config} is not valid JSON: {error}") from None
  return isinstance(loaded, dict) and "model_type" in loaded


def read_hf_config(path: str) -> tuple[dict[str, Any], ModelConfig]:
  """-> (config.json as a dict, its ModelConfig), reading no tensor; a malformed file, a
  missing or bad field raise ValueError naming the file (and the field)."""
  file = os.path.join(path, "config.json")
  with open(file) as f:
    try:
      hf_config = json.load(f)
    except ValueError as error:
      raise ValueError(f"{file} is not valid JSON: {error}") from None
  if not isinstance(hf_config, dict):
    raise ValueError(f"{file} must hold a JSON object, got {type(hf_config).__name__}")
  try:
    cfg = config_from_hf(hf_config, name=os.path.basename(os.path.normpath(path)))
  except KeyError as error:
    raise ValueError(f"{file} has no field {error.args[0]!r}, which its model_type "
                     f"{hf_config.get('model_type')!r} needs") from None
  except (TypeError, ValueError) as error:
    raise ValueError(f"{file}: {error}") from None
  _check_token_ids(hf_config, cfg, file)
  return hf_config, cfg


def _check_token_ids(hf: dict[str, Any], cfg: ModelConfig, file: str) -> None:
  """bos/eos/pad ids (where set) inside the vocabulary the embedding has."""
  for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
    value = hf.get(field)
    for token in value if isinstance(value, list) else [value]:
      if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                or not 0 <= token < cfg.vocab_size):
        raise ValueError(f"{file}: {field} {value!r} is not a token id in [0, vocab_size="
                         f"{cfg.vocab_size})")


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | YarnScaling | None]:
  params = dict(hf.get("rope_parameters") or {})
  scaling = hf.get("rope_scaling") or params
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if rope_type == "default":
    return theta, None
  if rope_type == "yarn":
    return theta, _yarn(hf, scaling)
  if rope_type != "llama3":
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3, yarn)")
  return theta, RopeScaling(
      factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def _yarn(hf: dict[str, Any], scaling: dict[str, Any]) -> YarnScaling:
  """HF _compute_yarn_parameters' constants: factor (default max / original positions),
  attention_factor (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio)."""
  original = int(scaling["original_max_position_embeddings"])
  factor = scaling.get("factor") or hf["max_position_embeddings"] / original
  mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
  return YarnScaling(
      factor=float(factor), original_max_position_embeddings=original,
      beta_fast=float(scaling.get("beta_fast") or 32),
      beta_slow=float(scaling.get("beta_slow") or 1),
      truncate=bool(scaling.get("truncate", True)), attention_factor=float(attention_factor))


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
  """Translate an HF config.json dict; unknown architectures raise naming them."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"unsupported model_type {model_type!r} "
                     f"(architectures {hf.get('architectures')}); "
                     f"supported: {SUPPORTED_MODEL_TYPES}")
  check_hf_fields(hf)
  if model_type in QWEN3_5_MODEL_TYPES:
    return qwen3_5_config(hf, name)
  theta, scaling = _rope(hf)
  if model_type in _DEEPSEEK:
    return _deepseek_config(hf, name, theta, scaling)
  num_heads = hf["num_attention_heads"]
  num_layers = hf["num_hidden_layers"]
  window = hf.get("sliding_window")
  layer_windows = None
  layer_types = hf.get("layer_types")
  if model_type in ("qwen2", "qwen3", "qwen3_moe", "gpt_oss"):
    # The window applies only to layers HF marks "sliding_attention".
    if layer_types is None and hf.get("use_sliding_window"):
      start = hf.get("max_window_layers", num_layers)
      layer_types = ["sliding_attention" if i >= start else "full_attention"
                     for i in range(num_layers)]
    layer_windows = tuple(window if t == "sliding_attention" else None
                          for t in (layer_types or ["full_attention"] * num_layers))
    window = None
    if not any(layer_windows):
      layer_windows = None
  eos = hf_eos_id(hf)
  gpt_oss = model_type == "gpt_oss"
  cfg = ModelConfig(
      name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"], num_layers=num_layers, num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
      max_position_embeddings=hf["max_position_embeddings"], rope_theta=theta,
      rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", gpt_oss)),
      attention_out_bias=gpt_oss and bool(hf.get("attention_bias", True)),
      qk_norm=model_type in ("qwen3", "qwen3_moe"), sliding_window=window,
      layer_windows=layer_windows, bos_token_id=hf.get("bos_token_id"), eos_token_id=eos,
      pad_token_id=hf.get("pad_token_id"), **moe_config(hf))
  return with_learned_sinks(cfg) if gpt_oss else cfg


def _deepseek_config(hf: dict[str, Any], name: str, theta: float,
                     scaling: RopeScaling | None) -> ModelConfig:
  """DeepSeek-V2/V3 with MLA; layers from first_k_dense_replace on are MoE (V3 only)."""
  num_layers = hf["num_hidden_layers"]
  first_dense = hf.get("first_k_dense_replace") or 0
  moe = moe_config(hf) if first_dense < num_layers else {}
  if first_dense < num_layers and hf.get("n_routed_experts") and not moe:
    raise ValueError(
        f"{hf['model_type']} checkpoint has MoE layers (first_k_dense_replace={first_dense} < "
        f"num_hidden_layers={num_layers}, n_routed_experts={hf['n_routed_experts']}); "
        "kvjax loads DeepSeek-V2 MLA models with dense MLPs only")
  if scaling is not None or hf.get("attention_bias"):
    raise ValueError("DeepSeek checkpoints with rope scaling or attention_bias are unsupported")
  eos = hf_eos_id(hf)
  num_heads = hf["num_attention_heads"]
  return ModelConfig(
      name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"], num_layers=num_layers, num_heads=num_heads,
      num_kv_heads=num_heads, head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
      max_position_embeddings=hf["max_position_embeddings"], rope_theta=theta,
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_type="mla", kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"),
      qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
      v_head_dim=hf["v_head_dim"], bos_token_id=hf.get("bos_token_id"), eos_token_id=eos,
      pad_token_id=hf.get("pad_token_id"),
      mtp_num_hidden_layers=(hf.get("num_nextn_predict_layers") or 0
                             if hf["model_type"] == "deepseek_v3" else 0), **moe)
