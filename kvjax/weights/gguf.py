"""Load GGUF checkpoints (llama.cpp's single-file format) into kvjax params.

Architectures: llama (Mistral too: llama.cpp writes it as llama, with
`llama.attention.sliding_window` when it has one), qwen2 (qkv bias), qwen3 (q/k
norm), gemma3 (the text decoder; `_gemma3_fields`); tensor types as
kvjax/weights/gguf_quants.py decodes them.  The file is
read through gguf.GGUFReader's memory map, one tensor at a time.

GGUF lists a tensor's shape fastest dimension first: a projection torch keeps as
[out, in] is ne = [in, out], rows of `in` contiguous elements, one per output
channel, so a row of blocks is one output channel's input groups and the
transpose to kvjax's input-major [I, O] puts those groups along I, where
QuantizedWeight wants them.  convert_hf_to_gguf reorders each llama q/k head's
rows from HF's rotate-half order to llama.cpp's interleaved rope pairs (row 2i + j
of a head holds HF row j H/2 + i); the loader undoes that on the stored rows
(for any tensor type: rows are whole output channels), as transformers' GGUF
loader does.  qwen2 / qwen3 rows are stored unpermuted.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import gguf
import jax.numpy as jnp
import numpy as np

from kvjax.model.config import ModelConfig
from kvjax.model.params import AttentionParams, BlockParams, Params
from kvjax.quant.qweight import quantize_weight
from kvjax.weights.config_checks import (MAX_CONTEXT, MAX_LAYERS, count_field,
                                         positive_real_field)
from kvjax.weights.gguf_header import check_gguf_header
from kvjax.weights.gguf_quants import blocks_qweight, check_type, dequantize, maps_blocks
from kvjax.weights.gguf_reader import GGUFArrayReader
from kvjax.weights.gguf_registry import REGISTRY, gguf_path, is_gguf, resolve_registry_name
from kvjax.weights.load_checks import raise_first_nonfinite
from kvjax.weights.quantize import SCHEMES, tied_head, weight_scheme

__all__ = ["SUPPORTED_ARCHITECTURES", "REGISTRY", "is_gguf", "gguf_path",
           "resolve_registry_name", "open_gguf", "config_from_gguf", "read_gguf_config",
           "load_gguf"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_ROPE_PERMUTED = ("llama",)  # architectures whose q/k rows convert_hf_to_gguf reorders
_MISSING = object()


def open_gguf(path: str) -> gguf.GGUFReader:
  """gguf.GGUFReader over `path`, its arrays read in one pass (gguf_reader.py); a
  truncated or corrupt file is a ValueError naming it and (gguf_header.py) the field."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path}")
  check_gguf_header(path)
  try:
    return GGUFArrayReader(path)
  except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
    raise ValueError(f"{path} is not a complete GGUF file ({os.path.getsize(path)} bytes; "
                     f"truncated or corrupt?): {e}") from e


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
  field = reader.fields.get(key)
  if field is None:
    if default is _MISSING:
      raise ValueError(f"GGUF file {reader.data.filename} has no metadata key {key!r}")
    return default
  return field.contents()


def _tensors(reader: gguf.GGUFReader) -> dict:
  """name -> ReaderTensor, every tensor's type checked before any is decoded."""
  tensors = {t.name: t for t in reader.tensors}
  for name, t in tensors.items():
    check_type(t.tensor_type.name, name)
  return tensors


def config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
  """Translate a GGUF file's metadata (the config is named after the file); unknown
  architectures or rope schemes raise naming them."""
  arch = _field(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"unsupported GGUF architecture {arch!r:.200} (general.architecture); "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
  tensors = {t.name: t for t in reader.tensors}
  where = f"GGUF file {reader.data.filename}"
  get = lambda key, default=_MISSING: _field(reader, f"{arch}.{key}", default)
  count = lambda key, default=_MISSING, high=None: count_field(
      where, f"{arch}.{key}", get(key, default), high)
  real = lambda key, default=_MISSING: positive_real_field(where, f"{arch}.{key}",
                                                           get(key, default))
  scaling = get("rope.scaling.type", "none")
  if scaling != "none" or "rope_freqs.weight" in tensors:
    scheme = (f"{arch}.rope.scaling.type {scaling!r:.200}" if scaling != "none" else
              "rope_freqs (llama3)")
    raise ValueError(f"{where}: rope scaling {scheme} is unsupported; kvjax loads GGUF "
                     "models with plain rope")
  num_heads, hidden = count("attention.head_count"), count("embedding_length")
  head_dim = count("attention.key_length", hidden // num_heads or 1)
  for key in ("attention.value_length", "rope.dimension_count"):
    if count(key, head_dim) != head_dim:
      raise ValueError(f"{where}: {arch}.{key} = {get(key)} differs from the key head dim "
                       f"{head_dim} ({arch}.attention.key_length); kvjax needs them equal")
  window = get("attention.sliding_window", None)
  if window is not None and arch not in ("llama", "gemma3"):
    raise ValueError(f"{where}: {arch} with a sliding window is "
                     "unsupported (GGUF does not record which of its layers slide)")
  embedding = tensors.get("token_embd.weight")
  if embedding is None or len(embedding.shape) != 2:
    raise ValueError(f"{where} has no 2-D tensor token_embd.weight (the embedding table)")
  num_layers = count("block_count", high=MAX_LAYERS)
  window = None if window is None else count("attention.sliding_window")
  layers = {}
  if arch == "gemma3":
    layers = _gemma3_fields(reader, get, num_layers, window, hidden // num_heads)
    window = None
  num_kv_heads, intermediate = count("attention.head_count_kv", num_heads), \
      count("feed_forward_length")
  _check_sizes_match_tensors(where, tensors, {
      "token_embd.weight": (0, hidden, f"{arch}.embedding_length"),
      "blk.0.ffn_up.weight": (1, intermediate, f"{arch}.feed_forward_length"),
      "blk.0.attn_q.weight": (1, num_heads * head_dim,
                              f"{arch}.attention.head_count x key_length"),
      "blk.0.attn_k.weight": (1, num_kv_heads * head_dim,
                              f"{arch}.attention.head_count_kv x key_length")})
  tokenizer = lambda key: _field(reader, f"tokenizer.ggml.{key}", None)
  return ModelConfig(
      name=os.path.splitext(os.path.basename(reader.data.filename))[0],
      vocab_size=count_field(where, "token_embd.weight ne[1]", int(embedding.shape[1])),
      hidden_size=hidden, intermediate_size=intermediate,
      num_layers=num_layers, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim,
      max_position_embeddings=count("context_length", high=MAX_CONTEXT),
      rope_theta=real("rope.freq_base", 10000.0),
      rms_norm_eps=real("attention.layer_norm_rms_epsilon"),
      tie_word_embeddings="output.weight" not in tensors,
      attention_bias="blk.0.attn_q.bias" in tensors,
      qk_norm="blk.0.attn_q_norm.weight" in tensors,
      sliding_window=window,
      bos_token_id=tokenizer("bos_token_id"), eos_token_id=tokenizer("eos_token_id"),
      pad_token_id=tokenizer("padding_token_id"), **layers)


def _gemma3_fields(reader: gguf.GGUFReader, get, num_layers: int, window: int,
                   width_per_head: int) -> dict:
  """Gemma 3's ModelConfig fields as llama.cpp builds the model from the file: every
  `sliding_window_pattern`-th layer (6) global at rope base `rope.freq_base`, the rest
  local (window, base `rope.freq_base_swa`: 10k); RMSNorm weights stored as 1 + w
  (convert_hf_to_gguf adds the 1), so kvjax's plain RMSNorm multiplies by them; tanh-GELU
  gate; embeddings times sqrt(width); q . k over sqrt(head_dim), or sqrt(width / heads)
  for the 62-layer 27B (query_pre_attn_scalar, which GGUF does not record)."""
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if get(key, None) is not None:
      raise ValueError(f"GGUF file {reader.data.filename}: gemma3.{key} is unsupported")
  pattern = int(get("attention.sliding_window_pattern", 6))
  is_global = [(i + 1) % pattern == 0 for i in range(num_layers)]
  local_theta = float(get("rope.freq_base_swa", 10000.0))
  return dict(layer_windows=tuple(None if g else window for g in is_global),
              layer_rope_thetas=tuple(None if g else local_theta for g in is_global),
              post_norms=True, scale_embeddings=True, mlp_activation="gelu_tanh",
              query_pre_attn_scalar=float(width_per_head) if num_layers == 62 else None)


def _check_sizes_match_tensors(where: str, tensors: dict, sizes: dict) -> None:
  """Each metadata size against the tensor it shapes, {tensor: (ne axis, size, field)},
  where the tensor is there (a missing one is named as the weights load): a size no
  tensor has would otherwise reach the memory fit check (2^31 feed_forward_length: "needs
  12288 GiB") before the loader that would name it."""
  for name, (axis, size, field) in sizes.items():
    t = tensors.get(name)
    if t is not None and len(t.shape) > axis and int(t.shape[axis]) != size:
      raise ValueError(f"{where}: {field} = {size} disagrees with tensor {name}, whose ne "
                       f"is {[int(x) for x in t.shape]} (ne[{axis}] should be {size})")


def read_gguf_config(path: str) -> ModelConfig:
  """The ModelConfig of the GGUF file at `path`, decoding no tensor."""
  return config_from_gguf(open_gguf(path))


def _unpermute_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
  """Undo convert_hf_to_gguf's q/k reorder on a tensor's output rows [heads * H, ...]."""
  return rows.reshape((heads, -1, 2) + rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def load_gguf(source, dtype=jnp.float32, weight_dtype: Optional[str] = None,
              check_finite: bool = True) -> tuple[ModelConfig, Params]:
  """A GGUF path or an open_gguf reader -> (config, params).  Float leaves are at
  `dtype`; `weight_dtype` ("int8", "int4" or a kvjax.weights.quantize scheme) keeps
  the projections (q, k, v, o, gate, up, down, an untied head) as QuantizedWeights,
  the file's own blocks where they fit (kvjax/weights/gguf_quants.py), and a tied
  head as int8 codes of the embedding: its blocks where they fit int8, else
  quantize.tied_head.  Embeddings and norms stay float.  `check_finite` counts
  NaN / inf in numpy as each tensor decodes (floats, or a QuantizedWeight's scales
  and offsets) and names the first."""
  scheme = weight_scheme(weight_dtype)
  reader = open_gguf(source) if isinstance(source, (str, os.PathLike)) else source
  path = reader.data.filename
  cfg = config_from_gguf(reader)
  tensors = _tensors(reader)
  permuted = _field(reader, "general.architecture") in _ROPE_PERMUTED
  read = _GGUFTensors(tensors, path, cfg.name, permuted, dtype, scheme, check_finite)
  blocks = tuple(_gguf_block(cfg, read, i) for i in range(cfg.num_layers))
  embed, head = _gguf_embed_and_head(cfg, read)
  params = Params(embed=embed, blocks=blocks,
                  final_norm=read.vector("output_norm.weight", (cfg.hidden_size,)),
                  lm_head=head)
  read.raise_first_nonfinite()
  return cfg, params


class _GGUFTensors:
  """A GGUF file's tensors by name, decoded as kvjax leaves: floats at `dtype`, projections
  under `scheme` (None: float).  With `check_finite` each decoded tensor's NaN / inf count
  is recorded in load order, so `raise_first_nonfinite` names the first bad one."""

  def __init__(self, tensors: dict, path: str, model_name: str, permuted: bool, dtype,
               scheme: Optional[str], check_finite: bool):
    self.tensors, self.path, self.model_name = tensors, path, model_name
    self.permuted = permuted  # q/k rows in llama.cpp's interleaved rope order
    self.dtype, self.scheme, self.check_finite = dtype, scheme, check_finite
    self.checked: list = []  # (tensor name, non-finite count, size) in load order

  def count(self, name: str, *arrays) -> None:
    if self.check_finite:
      arrays = [np.asarray(x) for x in arrays if x is not None]
      self.checked.append((name, sum(int(np.count_nonzero(~np.isfinite(x))) for x in arrays),
                           sum(x.size for x in arrays)))

  def rows(self, name: str, ne: tuple, heads: Optional[int] = None) -> tuple[np.ndarray, str]:
    """A tensor's stored rows, checked against its expected ne, q/k rope order undone."""
    if name not in self.tensors:
      raise ValueError(f"GGUF file {self.path} has no tensor {name} "
                       f"({self.model_name} needs it)")
    t = self.tensors[name]
    if tuple(int(x) for x in t.shape) != ne:
      raise ValueError(f"GGUF tensor {name} has ne {list(t.shape)}, expected {list(ne)}")
    raw = t.data
    if heads is not None and self.permuted:
      raw = _unpermute_rope_rows(raw, heads)
    return raw, t.tensor_type.name

  def floats(self, name: str, ne: tuple, heads: Optional[int] = None,
             stored=None) -> np.ndarray:
    """The tensor as float32 [*ne reversed] (from its `stored` rows when given)."""
    w = dequantize(*(stored or self.rows(name, ne, heads)))
    self.count(name, w)
    return w

  def vector(self, name: str, shape: tuple, heads: Optional[int] = None) -> jnp.ndarray:
    w = self.floats(name, (int(np.prod(shape)),), heads).reshape(shape)
    return jnp.asarray(w, self.dtype)

  def projection(self, name: str, shape: tuple, num_in: int, heads: Optional[int] = None):
    """kvjax weight [*in, *out] from GGUF ne [I, O]: float at dtype, or under `scheme`."""
    ne = (int(np.prod(shape[:num_in])), int(np.prod(shape[num_in:])))
    stored = self.rows(name, ne, heads)
    if self.scheme is not None and maps_blocks(stored[1], self.scheme):
      w = blocks_qweight(*stored, self.scheme, shape, num_in)
      self.count(name, w.scales, w.offsets)  # a non-finite value is a non-finite f16 field
      return w
    w = self.floats(name, ne, stored=stored).T.reshape(shape)  # [O, I] -> [*in, *out]
    if self.scheme is None:
      return jnp.asarray(w, self.dtype)
    bits, group = SCHEMES[self.scheme]
    return quantize_weight(jnp.asarray(w), num_in=num_in, bits=bits, group_size=group)

  def raise_first_nonfinite(self) -> None:
    if self.checked:
      names, counts, sizes = zip(*self.checked)
      raise_first_nonfinite(names, counts, sizes, f"GGUF file {self.path}")


def _gguf_block(cfg: ModelConfig, read: _GGUFTensors, i: int) -> BlockParams:
  """GGUF layer `i` (blk.i.*) -> BlockParams (tensors read in the order written here)."""
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  pre = f"blk.{i}."
  bias = cfg.attention_bias
  vector, projection = read.vector, read.projection
  attn = AttentionParams(
      wq=projection(pre + "attn_q.weight", (d, n, h), 1, n),
      wk=projection(pre + "attn_k.weight", (d, k, h), 1, k),
      wv=projection(pre + "attn_v.weight", (d, k, h), 1),
      wo=projection(pre + "attn_output.weight", (n, h, d), 2),
      bq=vector(pre + "attn_q.bias", (n, h), n) if bias else None,
      bk=vector(pre + "attn_k.bias", (k, h), k) if bias else None,
      bv=vector(pre + "attn_v.bias", (k, h)) if bias else None,
      q_norm=vector(pre + "attn_q_norm.weight", (h,)) if cfg.qk_norm else None,
      k_norm=vector(pre + "attn_k_norm.weight", (h,)) if cfg.qk_norm else None)
  post = cfg.post_norms
  return BlockParams(
      attn_norm=vector(pre + "attn_norm.weight", (d,)), attn=attn,
      mlp_norm=vector(pre + "ffn_norm.weight", (d,)),
      post_attn_norm=vector(pre + "post_attention_norm.weight", (d,)) if post else None,
      post_mlp_norm=vector(pre + "post_ffw_norm.weight", (d,)) if post else None,
      w_gate=projection(pre + "ffn_gate.weight", (d, f), 1),
      w_up=projection(pre + "ffn_up.weight", (d, f), 1),
      w_down=projection(pre + "ffn_down.weight", (f, d), 1))


def _gguf_embed_and_head(cfg: ModelConfig, read: _GGUFTensors) -> tuple:
  """-> (embedding at dtype, lm head: output.weight, or None when tied and float)."""
  d = cfg.hidden_size
  table = read.rows("token_embd.weight", (d, cfg.vocab_size))
  embed = jnp.asarray(read.floats("token_embd.weight", (d, cfg.vocab_size), stored=table),
                      read.dtype)
  if not cfg.tie_word_embeddings:
    head = read.projection("output.weight", (d, cfg.vocab_size), 1)
  elif read.scheme is None:
    head = None
  else:  # the table's own blocks as int8 codes where they fit (Q8_0, Q4_*, Q6_K)
    head = (blocks_qweight(*table, "int8", (d, cfg.vocab_size), 1)
            if maps_blocks(table[1], "int8") else tied_head(embed))
  return embed, head
