"""Tensor-parallel sizing: what one device of a tp-way mesh holds (kvjax/sharding.py's
placement rules), and the smallest tp whose devices fit a plan (kvjax/ledger.py's
single-device arithmetic, per device).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from kvjax import ledger
from kvjax.caches.layout import sizing_layout
from kvjax.config import ModelConfig
from kvjax.sharding import param_spec, replicated_kv_heads

__all__ = ["TPPlan", "weight_bytes_per_device", "kv_bytes_per_token_per_device", "tp_plan",
           "smallest_tp"]


def _leaf_shapes(cfg: ModelConfig, kv_heads: int) -> list[tuple[str, tuple]]:
  """(leaf name, shape) of every parameter kvjax places, kv_heads kv heads stored."""
  d, n, f = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
  if cfg.attention_type == "mla":
    r, hn, hr, hv = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                     cfg.v_head_dim)
    q = ([("wq_a", (d, cfg.q_lora_rank)), ("q_norm", (cfg.q_lora_rank,)),
          ("wq_b", (cfg.q_lora_rank, n, hn + hr))] if cfg.q_lora_rank else
         [("wq", (d, n, hn + hr))])
    attn = q + [("wkv_a", (d, r + hr)), ("kv_norm", (r,)), ("wk_b", (r, n, hn)),
                ("wv_b", (r, n, hv)), ("wo", (n, hv, d))]
  else:
    h = cfg.head_dim
    attn = [("wq", (d, n, h)), ("wk", (d, kv_heads, h)), ("wv", (d, kv_heads, h)),
            ("wo", (n, h, d))]
    attn += [("bq", (n, h)), ("bk", (kv_heads, h)), ("bv", (kv_heads, h))
             ] if cfg.attention_bias else []
    attn += [("q_norm", (h,)), ("k_norm", (h,))] if cfg.qk_norm else []
  block = attn + [("attn_norm", (d,)), ("mlp_norm", (d,)), ("w_gate", (d, f)),
                  ("w_up", (d, f)), ("w_down", (f, d))]
  mtp = [("embed_norm", (d,)), ("hidden_norm", (d,)), ("proj", (2 * d, d)),
         ("out_norm", (d,))] + block
  head = [] if cfg.tie_word_embeddings else [("lm_head", (d, cfg.vocab_size))]
  return ([("embed", (cfg.vocab_size, d)), ("final_norm", (d,))] + head +
          block * cfg.num_layers + mtp * cfg.mtp_num_hidden_layers)


def _stored_kv_heads(cfg: ModelConfig, tp: int) -> int:
  return cfg.num_kv_heads if cfg.attention_type == "mla" else replicated_kv_heads(
      cfg.num_kv_heads, tp)


def _check_tp_sizing(cfg: ModelConfig, tp: int) -> None:
  ledger.check_positive_int(tp, "tp")
  if cfg.num_experts:
    raise ValueError(f"{cfg.name!r} has MoE layers; tensor-parallel sizing covers dense "
                     "models only (kvjax/sharding.py has no expert rules)")


def weight_bytes_per_device(cfg: ModelConfig, tp: int, weight_dtype: str = "bf16") -> int:
  """Weight bytes on each device of a tp-way mesh: split leaves 1/tp, the rest whole."""
  _check_tp_sizing(cfg, tp)
  ledger.check_dtype(weight_dtype, "weight")
  total = 0
  for name, shape in _leaf_shapes(cfg, _stored_kv_heads(cfg, tp)):
    size = 1
    for dim in shape:
      size *= dim
    total += ledger.bytes_for(size // (tp if param_spec(name, shape, tp) else 1), weight_dtype)
  return total


def kv_bytes_per_token_per_device(cfg: ModelConfig, tp: int, kv_dtype: str = "bf16",
                                  include_mtp: bool = False,
                                  count_scales: bool = False) -> int:
  """KV bytes per token of history on each device: K'/tp kv heads of a layout whose
  cache splits kv heads (`HEAD_AXES`, kvjax/sharding.py), else the whole replicated
  pages (MLA's latent); scales follow their pages."""
  _check_tp_sizing(cfg, tp)
  if getattr(sizing_layout(kv_dtype, cfg).cache, "HEAD_AXES", None):
    cfg = cfg.replace(num_kv_heads=_stored_kv_heads(cfg, tp) // tp)
  total = ledger.kv_bytes_per_token(cfg, kv_dtype, include_mtp)
  if count_scales:
    total += ledger.kv_scale_bytes_per_token(cfg, kv_dtype, include_mtp)
  return total


@dataclasses.dataclass(frozen=True)
class TPPlan:
  """Per-device sizing on a tp-way mesh (the seeds' Q7/Q8 questions, per device)."""

  preset: str
  tp: int
  context: int
  batch: int
  stored_kv_heads: int  # K' = lcm(K, tp): kv heads the mesh stores (MLA: its K)
  kv_replication: int  # K' / K
  weight_bytes_per_device: int
  kv_bytes_per_token_per_device: int
  kv_replication_bytes_per_token: int  # mesh-wide bytes per token beyond one copy
  kv_bytes_per_request_per_device: int  # context tokens (windows not capped)
  free_kv_bytes_per_device: int
  max_concurrency: int
  fits: bool  # weights + batch requests + reserve on every device
  smallest_tp: Optional[int]  # the least power-of-two tp (<= 64) at which it fits


def _fits(cfg, context, batch, tp, kv_dtype, weight_dtype, gpu, reserve, include_mtp,
          count_scales) -> tuple[int, int, int]:
  """-> (weights, per-request KV, free KV bytes) per device."""
  weights = weight_bytes_per_device(cfg, tp, weight_dtype)
  per_request = context * kv_bytes_per_token_per_device(cfg, tp, kv_dtype, include_mtp,
                                                        count_scales)
  return weights, per_request, gpu - weights - reserve


def _splits(cfg: ModelConfig, tp: int) -> bool:
  """Whether kvjax/sharding.py can split cfg tp ways (heads, MLP, kv-head groups)."""
  if cfg.num_heads % tp or cfg.intermediate_size % tp:
    return False
  return cfg.attention_type == "mla" or cfg.num_heads % _stored_kv_heads(cfg, tp) == 0


def smallest_tp(cfg: ModelConfig, context: int, batch: int = 1, kv_dtype: str = "bf16",
                weight_dtype: str = "bf16", gpu_gib: float = 80.0, reserve_gib: float = 4.0,
                include_mtp: bool = False, count_scales: bool = False) -> Optional[int]:
  """The least power-of-two tp <= 64 at which weights and `batch` requests of
  `context` tokens fit every device; None if none does."""
  gpu = ledger.gib_to_bytes(gpu_gib, "gpu_gib")
  reserve = ledger.gib_to_bytes(reserve_gib, "reserve_gib")
  for tp in (1, 2, 4, 8, 16, 32, 64):
    if not _splits(cfg, tp):
      continue
    weights, per_request, free = _fits(cfg, context, batch, tp, kv_dtype, weight_dtype, gpu,
                                       reserve, include_mtp, count_scales)
    if batch * per_request <= free:
      return tp
  return None


def tp_plan(cfg: ModelConfig, context: int, tp: int, batch: int = 1, kv_dtype: str = "bf16",
            weight_dtype: str = "bf16", gpu_gib: float = 80.0, reserve_gib: float = 4.0,
            include_mtp: bool = False, count_scales: bool = False) -> TPPlan:
  """Sizes one device of a tp-way mesh; ValueError naming what does not split."""
  ledger.check_positive_int(context, "context")
  ledger.check_positive_int(batch, "batch")
  _check_tp_sizing(cfg, tp)
  if not _splits(cfg, tp):
    raise ValueError(f"{cfg.name!r} does not split over tp={tp}: num_heads {cfg.num_heads}, "
                     f"intermediate_size {cfg.intermediate_size}, num_kv_heads "
                     f"{cfg.num_kv_heads} (stored {_stored_kv_heads(cfg, tp)})")
  gpu = ledger.gib_to_bytes(gpu_gib, "gpu_gib")
  reserve = ledger.gib_to_bytes(reserve_gib, "reserve_gib")
  if gpu == 0:
    raise ValueError(f"gpu_gib must be > 0, got {gpu_gib!r}")
  weights, per_request, free = _fits(cfg, context, batch, tp, kv_dtype, weight_dtype, gpu,
                                     reserve, include_mtp, count_scales)
  per_token = kv_bytes_per_token_per_device(cfg, tp, kv_dtype, include_mtp, count_scales)
  one_copy = kv_bytes_per_token_per_device(cfg, 1, kv_dtype, include_mtp, count_scales)
  stored = _stored_kv_heads(cfg, tp)
  return TPPlan(
      preset=cfg.name, tp=tp, context=context, batch=batch, stored_kv_heads=stored,
      kv_replication=stored // cfg.num_kv_heads, weight_bytes_per_device=weights,
      kv_bytes_per_token_per_device=per_token,
      kv_replication_bytes_per_token=tp * per_token - one_copy,
      kv_bytes_per_request_per_device=per_request, free_kv_bytes_per_device=free,
      max_concurrency=ledger.max_concurrency(free, per_request),
      fits=batch * per_request <= free,
      smallest_tp=smallest_tp(cfg, context, batch, kv_dtype, weight_dtype, gpu_gib,
                              reserve_gib, include_mtp, count_scales))
