"""Load HF transformers checkpoints (config.json + safetensors) into kvjax params.

The config is read by kvjax/weights/hf_config.py (which lists the supported
`model_type`s); MoE layers' tensors by hf_moe.py, Qwen3.5 hybrids by hf_qwen3_5.py.
Torch stores projections as [out, in]; kvjax keeps them input-major with heads
split out ([D, N, H] etc.), so each tensor is transposed once here, after
kvjax/weights/hf_contract.py has checked every tensor's shape and dtype against
the config.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.layer_kinds import layer_kind
from kvjax.model.learned_sinks import LEARNED_SINKS, SinkAttentionParams
from kvjax.model.params import AttentionParams, BlockParams, MLAParams, MTPParams, Params
from kvjax.parallel.sharding import place_host_params
from kvjax.weights.hf_config import read_hf_config
from kvjax.weights.hf_contract import check_hf_tensors, mtp_copies
from kvjax.weights.hf_moe import moe_params
from kvjax.weights.hf_qwen3_5 import QWEN3_5_MODEL_TYPES, load_qwen3_5
from kvjax.weights.load_checks import check_finite_tree, nonfinite_count, raise_first_nonfinite

__all__ = ["load_hf"]

# safetensors dtype codes -> numpy (ml_dtypes supplies bfloat16).
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                       "BF16": jnp.bfloat16, "I64": np.int64, "I32": np.int32, "I8": np.int8,
                       "U8": np.uint8, "BOOL": np.bool_}


def _mla_params(cfg: ModelConfig, get: Callable[[str], jnp.ndarray], pre: str,
                interleaved_rope: bool) -> MLAParams:
  """HF MLA tensors -> MLAParams; interleaved rope columns become evens-then-odds
  (kvjax/model/decoder.py mla_attention explains why that equals HF's interleaved rope)."""
  d, n, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
  hn, hr, hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  rope_perm = np.concatenate([np.arange(0, hr, 2), np.arange(1, hr, 2)])
  if not interleaved_rope:
    rope_perm = np.arange(hr)
  q_perm = np.concatenate([np.arange(hn), hn + rope_perm])
  kv_perm = np.concatenate([np.arange(r), r + rope_perm])

  def q_proj(name, rows):  # torch [N*(Hn+Hr), rows] -> [rows, N, Hn+Hr], rope permuted
    return get(name).T.reshape(rows, n, hn + hr)[..., q_perm]

  kv_b = get(pre + "kv_b_proj.weight").T.reshape(r, n, hn + hv)
  if cfg.q_lora_rank is None:
    q = dict(wq=q_proj(pre + "q_proj.weight", d))
  else:
    q = dict(wq_a=get(pre + "q_a_proj.weight").T, q_norm=get(pre + "q_a_layernorm.weight"),
             wq_b=q_proj(pre + "q_b_proj.weight", cfg.q_lora_rank))
  return MLAParams(
      wkv_a=get(pre + "kv_a_proj_with_mqa.weight").T[:, kv_perm],
      kv_norm=get(pre + "kv_a_layernorm.weight"), wk_b=kv_b[..., :hn], wv_b=kv_b[..., hn:],
      wo=get(pre + "o_proj.weight").T.reshape(n, hv, d), **q)


def _mmap_tensors(file: str) -> dict[str, np.ndarray]:
  """name -> read-only memory-mapped numpy view of each tensor of one .safetensors file."""
  with open(file, "rb") as f:
    header_size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(header_size))
  tensors = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    begin, end = info["data_offsets"]
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    tensors[name] = (np.memmap(file, dtype, "r", offset=8 + header_size + begin, shape=shape)
                     if end > begin else np.zeros(shape, dtype))
  return tensors


def _open_safetensors(file: str, mmap: bool):
  """safe_open(file) or its _mmap_tensors; a truncated or corrupt file is a ValueError
  naming it (safetensors checks the header against the file's size as it opens)."""
  from safetensors import SafetensorError, safe_open

  try:
    return _mmap_tensors(file) if mmap else safe_open(file, framework="flax")
  except (SafetensorError, ValueError, KeyError, TypeError) as error:
    raise ValueError(f"{file} is not a complete safetensors file ({os.path.getsize(file)} "
                     f"bytes; truncated or corrupt?): {error}") from None


def _tensor_reader(path: str, mmap: bool = False) -> Callable[[str], np.ndarray]:
  """name -> array over model.safetensors or a sharded model.safetensors.index.json
  (`mmap`: a memory-mapped host view, nothing read until a slice is used)."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      files = json.load(f)["weight_map"]
  else:
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
      raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    files = None
  handles = {}

  def read(name: str):
    file = files.get(name) if files is not None else "model.safetensors"
    if file is None:
      raise KeyError(f"checkpoint {path} is missing tensor {name!r}")
    if file not in handles:
      handles[file] = _open_safetensors(os.path.join(path, file), mmap)
    if name not in handles[file].keys():
      raise KeyError(f"checkpoint {path} is missing tensor {name!r}")
    return handles[file][name] if mmap else handles[file].get_tensor(name)

  return read


def load_hf(path: str, dtype=jnp.float32, check_finite: bool = True, mesh=None
            ) -> tuple[ModelConfig, Params]:
  """-> (config, params at `dtype`); `check_finite` raises naming the first HF
  tensor with a NaN or inf (counted on device as each tensor loads).

  On a `mesh` the tensors are memory-mapped, rearranged as host views and
  placed shard by shard (kvjax/parallel/sharding.py), each device reading its slice;
  `check_finite` then names the first kvjax parameter with a NaN or inf.
  """
  hf_config, cfg = read_hf_config(path)
  cfg = check_hf_tensors(path, hf_config, cfg,
                         shapes=hf_config.get("model_type") not in QWEN3_5_MODEL_TYPES)
  tensors = _HFTensors(_tensor_reader(path, mmap=mesh is not None), dtype, mesh, check_finite)
  if hf_config.get("model_type") in QWEN3_5_MODEL_TYPES:
    cfg, params = load_qwen3_5(cfg, hf_config, tensors.get, tensors.has)
  else:
    params = _decoder_params(cfg, hf_config, tensors.get, tensors.read, path)
  return cfg, tensors.finish(params, path)


class _HFTensors:
  """A checkpoint's tensors by HF name. Off a mesh each loads at `dtype` and, with
  `check_finite`, its NaN/inf count is recorded in load order, so `finish` names the
  first bad tensor; on a mesh they stay host views until `finish` places them."""

  def __init__(self, read: Callable[[str], np.ndarray], dtype, mesh, check_finite: bool):
    self.read, self.dtype, self.mesh, self.check_finite = read, dtype, mesh, check_finite
    self.names, self.nonfinite, self.sizes = [], [], []  # per tensor, in load order

  def get(self, name: str):
    if self.mesh is not None:
      return self.read(name)
    tensor = jnp.asarray(self.read(name), self.dtype)
    if self.check_finite:
      self.names.append(name)
      self.nonfinite.append(nonfinite_count(tensor))
      self.sizes.append(tensor.size)
    return tensor

  def has(self, name: str) -> bool:
    try:
      self.read(name)
    except KeyError:
      return False
    return True

  def finish(self, params: Params, path: str) -> Params:
    """-> `params` placed on the mesh (if any), after the finiteness check."""
    if self.mesh is not None:
      params = place_host_params(params, self.mesh, self.dtype)
      if self.check_finite:
        check_finite_tree(params, f"HF checkpoint {path}")
      return params
    if self.check_finite:
      raise_first_nonfinite(self.names, self.nonfinite, self.sizes, f"HF checkpoint {path}")
    return params


def _decoder_params(cfg: ModelConfig, hf_config: dict[str, Any], get: Callable[[str], Any],
                    read: Callable[[str], np.ndarray], path: str) -> Params:
  """The decoder's Params (every model type but the Qwen3.5 hybrids), with
  DeepSeek-V3's MTP layers after the trunk's."""
  # DeepSeek-V2 always rotates interleaved pairs; V3 unless rope_interleave is false.
  interleaved_rope = hf_config.get("model_type") == "deepseek_v2" or bool(
      hf_config.get("rope_interleave", True))

  def block(i: int) -> BlockParams:  # decoder layer i (DeepSeek-V3's MTP layers: i >= L)
    return _block_params(cfg, hf_config["model_type"], get, i, interleaved_rope)

  params = Params(
      embed=get("model.embed_tokens.weight"),
      blocks=tuple(block(i) for i in range(cfg.num_layers)),
      final_norm=get("model.norm.weight"),
      lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight").T)
  _check_mtp_copies(cfg, hf_config, read, path)
  mtp = tuple(_deepseek_mtp(get, block, cfg.num_layers + depth)
              for depth in range(cfg.mtp_num_hidden_layers))
  return params.replace(mtp=mtp)


def _block_params(cfg: ModelConfig, model_type: str, get: Callable[[str], Any], i: int,
                  interleaved_rope: bool) -> BlockParams:
  """HF decoder layer `i` -> BlockParams (tensors read in the order written here)."""
  pre = f"model.layers.{i}."
  if cfg.attention_type == "mla":
    attn = _mla_params(cfg, get, pre + "self_attn.", interleaved_rope)
  else:
    attn = _attention_params(cfg, get, pre + "self_attn.", i)
  if cfg.is_moe_layer(i):
    mlp = dict(moe=moe_params(cfg, model_type, get, pre))
  else:
    mlp = dict(w_gate=get(pre + "mlp.gate_proj.weight").T,
               w_up=get(pre + "mlp.up_proj.weight").T,
               w_down=get(pre + "mlp.down_proj.weight").T)
  return BlockParams(
      attn_norm=get(pre + "input_layernorm.weight"), attn=attn,
      mlp_norm=get(pre + "post_attention_layernorm.weight"), **mlp)


def _attention_params(cfg: ModelConfig, get: Callable[[str], Any], pre: str, i: int
                      ) -> AttentionParams | SinkAttentionParams:
  """HF q/k/v/o projections (+ biases, q/k norms, learned sinks) of layer `i`."""
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  bias = cfg.attention_bias

  def proj(name, heads):  # torch [heads*H, D] -> [D, heads, H]
    return get(name).T.reshape(d, heads, h)

  attn = AttentionParams(
      wq=proj(pre + "q_proj.weight", n),
      wk=proj(pre + "k_proj.weight", k), wv=proj(pre + "v_proj.weight", k),
      wo=get(pre + "o_proj.weight").T.reshape(n, h, d),
      bq=get(pre + "q_proj.bias").reshape(n, h) if bias else None,
      bk=get(pre + "k_proj.bias").reshape(k, h) if bias else None,
      bv=get(pre + "v_proj.bias").reshape(k, h) if bias else None,
      bo=get(pre + "o_proj.bias") if cfg.attention_out_bias else None,
      q_norm=get(pre + "q_norm.weight") if cfg.qk_norm else None,
      k_norm=get(pre + "k_norm.weight") if cfg.qk_norm else None)
  if layer_kind(cfg, i) is LEARNED_SINKS:
    attn = SinkAttentionParams(attn=attn, sinks=get(pre + "sinks"))
  return attn


def _deepseek_mtp(get: Callable[[str], Any], block: Callable[[int], BlockParams],
                  layer: int) -> MTPParams:
  """DeepSeek-V3's MTP layer `layer` (>= num_hidden_layers; transformers drops it):
  h = layer(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])), logits through
  shared_head.norm and the trunk's head (the copy it stores was checked equal)."""
  pre = f"model.layers.{layer}."
  return MTPParams(embed_norm=get(pre + "enorm.weight"), hidden_norm=get(pre + "hnorm.weight"),
                   proj=get(pre + "eh_proj.weight").T, block=block(layer),
                   out_norm=get(pre + "shared_head.norm.weight"))


def _check_mtp_copies(cfg: ModelConfig, hf: dict[str, Any], read, path: str) -> None:
  """kvjax's MTP modules share the trunk's embedding and head, so each copy a DeepSeek-V3
  checkpoint stores must equal it (a different one would compute something else)."""
  for name, trunk in mtp_copies(cfg, hf.get("model_type", "")).items():
    try:
      copy = np.asarray(read(name))
    except KeyError:
      continue
    if not np.array_equal(copy, np.asarray(read(trunk))):
      raise ValueError(f"HF checkpoint {path}: tensor {name} differs from {trunk}; kvjax's "
                       "MTP layers share the trunk's embedding and head")
