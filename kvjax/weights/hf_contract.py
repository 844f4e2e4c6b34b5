"""The contract between an HF checkpoint's config.json and its tensors, checked
before any tensor is read.

`check_hf_tensors` reads only the safetensors headers (names, shapes, dtypes)
and compares them with the tensors the config implies (torch layouts, e.g.
q_proj [N*H, D]): a missing tensor, a wrong shape or a non-float dtype raises
naming the tensor, what the config expects and what the file holds; a tensor
kvjax would not use raises naming it too, since ignoring it would compute
something else than the checkpoint means (an o_proj bias, a layer beyond
num_hidden_layers), except the ones transformers itself ignores (rotary
inv_freq buffers, DeepSeek-V3's next-token-prediction layers where the first lacks
its eh_proj), which a warning names.  DeepSeek-V3's MTP layers, where the checkpoint
has them, are expected whole: enorm, hnorm, eh_proj, shared_head.norm and a decoder
layer each (the embedding and head they repeat are optional, shaped as the trunk's).
A config that ties the head to the embedding over a checkpoint that
stores lm_head.weight gets that head, as transformers loads it (a warning says so).
The dense (llama, mistral, qwen2, qwen3; gpt_oss's o_proj bias and sinks), MoE
(kvjax/weights/hf_moe.py) and DeepSeek MLA layouts are checked tensor by tensor;
the qwen3_5 hybrids' dtypes only.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from kvjax.model.config import ModelConfig
from kvjax.model.layer_kinds import layer_kind
from kvjax.model.learned_sinks import LEARNED_SINKS
from kvjax.weights.hf_moe import moe_tensors

__all__ = ["FLOAT_DTYPES", "safetensors_headers", "expected_tensors", "mtp_copies",
           "check_hf_tensors"]

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors codes kvjax casts from
# Buffers transformers never loads (its _keys_to_ignore_on_load_unexpected).
_IGNORED = re.compile(r"(.*\.)?rotary_emb\.inv_freq$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def safetensors_headers(path: str) -> dict[str, tuple[tuple, str]]:
  """name -> (shape, safetensors dtype code) of every tensor of the checkpoint at `path`
  (model.safetensors or the shards of model.safetensors.index.json), headers only."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  tensors = {}
  for name in files:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      raise FileNotFoundError(f"checkpoint {path}: no {name} (no model.safetensors or "
                              "model.safetensors.index.json shard)")
    with open(file, "rb") as f:
      size = int.from_bytes(f.read(8), "little")
      if size > os.path.getsize(file) - 8:
        raise ValueError(f"{file}: safetensors header of {size} bytes is past the file's end "
                         "(truncated?)")
      try:
        header = json.loads(f.read(size))
      except ValueError as error:
        raise ValueError(f"{file}: the safetensors header is not valid JSON: {error}") from None
    for tensor, info in header.items():
      if tensor != "__metadata__":
        tensors[tensor] = (tuple(info["shape"]), info["dtype"])
  return tensors


def _dense_layer(cfg: ModelConfig, pre: str, layer: int) -> dict[str, tuple]:
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  a = pre + "self_attn."
  out = {a + "q_proj.weight": (n * h, d), a + "k_proj.weight": (k * h, d),
         a + "v_proj.weight": (k * h, d), a + "o_proj.weight": (d, n * h)}
  if cfg.attention_bias:
    out.update({a + "q_proj.bias": (n * h,), a + "k_proj.bias": (k * h,),
                a + "v_proj.bias": (k * h,)})
  if cfg.attention_out_bias:
    out[a + "o_proj.bias"] = (d,)
  if layer_kind(cfg, layer) is LEARNED_SINKS:
    out[a + "sinks"] = (n,)
  if cfg.qk_norm:
    out.update({a + "q_norm.weight": (h,), a + "k_norm.weight": (h,)})
  return out


def _mla_layer(cfg: ModelConfig, pre: str, layer: int) -> dict[str, tuple]:
  del layer
  d, n, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
  hn, hr, hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  a = pre + "self_attn."
  out = {a + "kv_a_proj_with_mqa.weight": (r + hr, d), a + "kv_a_layernorm.weight": (r,),
         a + "kv_b_proj.weight": (n * (hn + hv), r), a + "o_proj.weight": (d, n * hv)}
  if cfg.q_lora_rank is None:
    out[a + "q_proj.weight"] = (n * (hn + hr), d)
  else:
    out.update({a + "q_a_proj.weight": (cfg.q_lora_rank, d),
                a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                a + "q_b_proj.weight": (n * (hn + hr), cfg.q_lora_rank)})
  return out


def expected_tensors(cfg: ModelConfig, model_type: str = "") -> dict[str, tuple]:
  """name -> torch shape of every tensor kvjax reads for `cfg` (dense or MLA layouts;
  MoE layers named as `model_type`'s, kvjax/weights/hf_moe.py)."""
  d, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = (v, d)
  attention = _mla_layer if cfg.attention_type == "mla" else _dense_layer
  mtp = cfg.mtp_num_hidden_layers if model_type == "deepseek_v3" else 0
  for layer in range(cfg.num_layers + mtp):  # DeepSeek-V3's MTP layers follow the trunk's
    pre = f"model.layers.{layer}."
    if layer >= cfg.num_layers:
      out.update({pre + "enorm.weight": (d,), pre + "hnorm.weight": (d,),
                  pre + "eh_proj.weight": (d, 2 * d), pre + "shared_head.norm.weight": (d,)})
    out.update(attention(cfg, pre, layer))
    out.update({pre + "input_layernorm.weight": (d,),
                pre + "post_attention_layernorm.weight": (d,)})
    if cfg.is_moe_layer(layer):
      out.update(moe_tensors(cfg, model_type, pre))
      continue
    out.update({pre + "mlp.gate_proj.weight": (i, d), pre + "mlp.up_proj.weight": (i, d),
                pre + "mlp.down_proj.weight": (d, i)})
  return out


def mtp_copies(cfg: ModelConfig, model_type: str = "") -> dict[str, str]:
  """DeepSeek-V3 MTP tensors that repeat a trunk tensor (its checkpoints store the shared
  embedding and head again per MTP layer): name -> the trunk tensor they must equal."""
  if model_type != "deepseek_v3":
    return {}
  head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
  out = {}
  for layer in range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_hidden_layers):
    out[f"model.layers.{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
    out[f"model.layers.{layer}.shared_head.head.weight"] = head
  return out


def _ignored_by_transformers(name: str, cfg: ModelConfig, hf: dict[str, Any]) -> bool:
  """Tensors transformers itself skips for this architecture, so kvjax may too."""
  if _IGNORED.match(name):
    return True
  layer = _LAYER.match(name)
  extra_layers = hf.get("num_nextn_predict_layers") or 0
  return (hf.get("model_type") == "deepseek_v3" and layer is not None
          and cfg.num_layers <= int(layer.group(1)) < cfg.num_layers + extra_layers)


def check_hf_tensors(path: str, hf: dict[str, Any], cfg: ModelConfig,
                     shapes: bool = True) -> ModelConfig:
  """Raise ValueError unless the checkpoint at `path` holds exactly the float tensors
  `cfg` (read from `hf`, its config.json) implies, at their shapes (`shapes` False:
  dtypes only); warn naming the tensors transformers also ignores.  -> `cfg`, untied
  when it ties the head but the checkpoint stores one."""
  found = safetensors_headers(path)
  where = f"HF checkpoint {path}"
  for name, (_, dtype) in found.items():
    if dtype not in FLOAT_DTYPES:
      raise ValueError(f"{where}: tensor {name} has dtype {dtype}; expected a float dtype "
                       f"({', '.join(FLOAT_DTYPES)})")
  if not shapes:
    return cfg
  if cfg.tie_word_embeddings and "lm_head.weight" in found:
    warnings.warn(f"{where}: config.json ties the head to the embedding but the checkpoint "
                  "stores lm_head.weight; using it, as transformers does", stacklevel=3)
    cfg = cfg.replace(tie_word_embeddings=False)
  model_type = hf.get("model_type", "")
  first_mtp = f"model.layers.{cfg.num_layers}.eh_proj.weight"
  if model_type == "deepseek_v3" and cfg.mtp_num_hidden_layers and first_mtp not in found:
    cfg = cfg.replace(mtp_num_hidden_layers=0)  # HF's save_pretrained drops the MTP layers
  expected = expected_tensors(cfg, model_type)
  for name, trunk in mtp_copies(cfg, model_type).items():
    if name in found and trunk in found:  # optional copies, shaped as what they repeat
      expected[name] = found[trunk][0]
  for name, shape in expected.items():
    if name not in found:
      raise ValueError(f"{where}: tensor {name} is missing (config.json implies shape "
                       f"{shape})")
    if found[name][0] != shape:
      raise ValueError(f"{where}: tensor {name} has shape {found[name][0]}; config.json "
                       f"implies {shape}")
  unused = sorted(set(found) - set(expected))
  ignored = [name for name in unused if _ignored_by_transformers(name, cfg, hf)]
  refused = [name for name in unused if name not in ignored]
  if refused:
    raise ValueError(f"{where}: tensors {refused} are not part of the {hf.get('model_type')} "
                     "model config.json describes (kvjax would ignore them and compute "
                     "something else)")
  if ignored:
    warnings.warn(f"{where}: ignoring tensors {ignored} (unused by this architecture, as in "
                  "transformers)", stacklevel=3)
  return cfg
