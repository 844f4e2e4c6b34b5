"""Tensor- and expert-parallel sizing: what one device of a tp-way (x ep-way) mesh holds
(kvjax/parallel/sharding.py's placement rules), and the smallest tp, or ep, whose devices fit a
plan (kvjax/parallel/ledger.py's single-device arithmetic, per device).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from kvjax.caches.layout import sizing_layout
from kvjax.model.config import ModelConfig
from kvjax.parallel import ledger
from kvjax.parallel.sharding import check_experts_split, param_spec, replicated_kv_heads

__all__ = ["TPPlan", "weight_bytes_per_device", "expert_bytes_per_device",
           "kv_bytes_per_token_per_device", "tp_plan", "smallest_tp", "smallest_ep"]

_POWERS = (1, 2, 4, 8, 16, 32, 64)


def _mlp_leaves(cfg: ModelConfig, layer: int) -> list[tuple[str, tuple, int]]:
  """(leaf name, shape, copies) of layer's MLP: a routed expert's leaves come Ne times
  (copies Ne, each split Ne / ep over "expert"), every other leaf once (copies 0)."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  if not cfg.is_moe_layer(layer):
    return [("w_gate", (d, f), 0), ("w_up", (d, f), 0), ("w_down", (f, d), 0)]
  ne, fe, shared = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_shared_experts
  leaves = [("router", (d, ne), 0)]
  leaves += [("router_bias", (ne,), 0)] if cfg.moe_bias else []
  leaves += [("score_bias", (ne,), 0)] if cfg.moe_score_bias else []
  if shared:
    leaves += [("w_gate", (d, shared * fe), 0), ("w_up", (d, shared * fe), 0),
               ("w_down", (shared * fe, d), 0)]
  routed = [("w_gate", (d, fe)), ("w_up", (d, fe)), ("w_down", (fe, d))]
  routed += [("b_gate", (fe,)), ("b_up", (fe,)), ("b_down", (d,))] if cfg.moe_bias else []
  return leaves + [(name, shape, ne) for name, shape in routed]


def _leaf_shapes(cfg: ModelConfig, kv_heads: int) -> list[tuple[str, tuple, int]]:
  """(leaf name, shape, copies) of every parameter kvjax places, kv_heads kv heads stored
  (copies: `_mlp_leaves`)."""
  d, n = cfg.hidden_size, cfg.num_heads
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
  once = lambda leaves: [(name, shape, 0) for name, shape in leaves]
  norms = [("attn_norm", (d,)), ("mlp_norm", (d,))]
  norms += [("post_attn_norm", (d,)), ("post_mlp_norm", (d,))] if cfg.post_norms else []
  block = lambda layer: once(attn + norms) + _mlp_leaves(cfg, layer)
  mtp = once([("embed_norm", (d,)), ("hidden_norm", (d,)), ("proj", (2 * d, d)),
              ("out_norm", (d,))])
  head = [] if cfg.tie_word_embeddings else [("lm_head", (d, cfg.vocab_size))]
  return (once([("embed", (cfg.vocab_size, d)), ("final_norm", (d,))] + head) +
          [leaf for layer in range(cfg.num_layers) for leaf in block(layer)] +
          [leaf for i in range(cfg.mtp_num_hidden_layers)
           for leaf in mtp + block(cfg.num_layers + i)])


def _stored_kv_heads(cfg: ModelConfig, tp: int) -> int:
  return cfg.num_kv_heads if cfg.attention_type == "mla" else replicated_kv_heads(
      cfg.num_kv_heads, tp)


def _check_sizing(cfg: ModelConfig, tp: int, ep: int = 1) -> None:
  ledger.check_positive_int(tp, "tp")
  ledger.check_positive_int(ep, "ep")
  check_experts_split(cfg, ep)


def _bytes_per_device(cfg: ModelConfig, tp: int, ep: int, weight_dtype: str,
                      experts_only: bool) -> int:
  """Bytes of cfg's leaves (`experts_only`: its routed experts') on one device."""
  _check_sizing(cfg, tp, ep)
  ledger.check_dtype(weight_dtype, "weight")
  total = 0
  for name, shape, copies in _leaf_shapes(cfg, _stored_kv_heads(cfg, tp)):
    if experts_only and not copies:
      continue
    size = 1
    for dim in shape:
      size *= dim
    per_leaf = ledger.bytes_for(size // (tp if param_spec(name, shape, tp) else 1),
                                weight_dtype)
    total += per_leaf * (copies // ep if copies else 1)
  return total


def weight_bytes_per_device(cfg: ModelConfig, tp: int, weight_dtype: str = "bf16",
                            ep: int = 1) -> int:
  """Weight bytes on each device of a tp-way (x ep-way) mesh: split leaves 1/tp, routed
  experts Ne / ep of them a device, the rest whole."""
  return _bytes_per_device(cfg, tp, ep, weight_dtype, experts_only=False)


def expert_bytes_per_device(cfg: ModelConfig, tp: int, weight_dtype: str = "bf16",
                            ep: int = 1) -> int:
  """The routed experts' share of weight_bytes_per_device: Ne / ep experts, 1/tp of each."""
  return _bytes_per_device(cfg, tp, ep, weight_dtype, experts_only=True)


def kv_bytes_per_token_per_device(cfg: ModelConfig, tp: int, kv_dtype: str = "bf16",
                                  include_mtp: bool = False,
                                  count_scales: bool = False) -> int:
  """KV bytes per token of history on each device: K'/tp kv heads of a layout whose
  cache splits kv heads (`HEAD_AXES`, kvjax/parallel/sharding.py), else the whole replicated
  pages (MLA's latent); scales follow their pages."""
  _check_sizing(cfg, tp)
  if getattr(sizing_layout(kv_dtype, cfg).cache, "HEAD_AXES", None):
    cfg = cfg.replace(num_kv_heads=_stored_kv_heads(cfg, tp) // tp)
  total = ledger.kv_bytes_per_token(cfg, kv_dtype, include_mtp)
  if count_scales:
    total += ledger.kv_scale_bytes_per_token(cfg, kv_dtype, include_mtp)
  return total


@dataclasses.dataclass(frozen=True)
class TPPlan:
  """Per-device sizing on a tp-way (x ep-way) mesh (the seeds' Q7/Q8 questions, per
  device)."""

  preset: str
  tp: int
  context: int
  batch: int
  stored_kv_heads: int  # K' = lcm(K, tp): kv heads the mesh stores (MLA: its K)
  kv_replication: int  # K' / K
  weight_bytes_per_device: int
  kv_bytes_per_token_per_device: int
  kv_replication_bytes_per_token: int  # mesh-wide bytes per token beyond one copy (x ep)
  kv_bytes_per_request_per_device: int  # context tokens (windows not capped)
  free_kv_bytes_per_device: int
  max_concurrency: int
  fits: bool  # weights + batch requests + reserve on every device
  smallest_tp: Optional[int]  # the least power-of-two tp (<= 64) at which it fits, at this ep
  ep: int = 1  # expert-parallel degree (the KV cache is replicated along "expert")
  expert_bytes_per_device: int = 0  # the routed experts' share of weight_bytes_per_device
  smallest_ep: Optional[int] = None  # the least power-of-two ep (<= Ne) that fits, at this tp


def _fits(cfg, context, batch, tp, ep, kv_dtype, weight_dtype, gpu, reserve, include_mtp,
          count_scales) -> tuple[int, int, int]:
  """-> (weights, per-request KV, free KV bytes) per device."""
  weights = weight_bytes_per_device(cfg, tp, weight_dtype, ep)
  per_request = context * kv_bytes_per_token_per_device(cfg, tp, kv_dtype, include_mtp,
                                                        count_scales)
  return weights, per_request, gpu - weights - reserve


def _splits(cfg: ModelConfig, tp: int, ep: int = 1) -> bool:
  """Whether kvjax/parallel/sharding.py can split cfg tp ways (heads, MLPs, kv-head groups) and
  its experts ep ways."""
  if cfg.num_heads % tp or cfg.intermediate_size % tp or (ep > 1 and not cfg.num_experts):
    return False
  if cfg.num_experts and (cfg.num_experts % ep or cfg.moe_intermediate_size % tp):
    return False
  return cfg.attention_type == "mla" or cfg.num_heads % _stored_kv_heads(cfg, tp) == 0


def _first_fit(cfg, context, batch, sizes, kv_dtype, weight_dtype, gpu_gib, reserve_gib,
               include_mtp, count_scales) -> Optional[tuple[int, int]]:
  """The first (tp, ep) of `sizes` that splits and fits every device; None if none does."""
  gpu = ledger.gib_to_bytes(gpu_gib, "gpu_gib")
  reserve = ledger.gib_to_bytes(reserve_gib, "reserve_gib")
  for tp, ep in sizes:
    if not _splits(cfg, tp, ep):
      continue
    _, per_request, free = _fits(cfg, context, batch, tp, ep, kv_dtype, weight_dtype, gpu,
                                 reserve, include_mtp, count_scales)
    if batch * per_request <= free:
      return tp, ep
  return None


def smallest_tp(cfg: ModelConfig, context: int, batch: int = 1, kv_dtype: str = "bf16",
                weight_dtype: str = "bf16", gpu_gib: float = 80.0, reserve_gib: float = 4.0,
                include_mtp: bool = False, count_scales: bool = False,
                ep: int = 1) -> Optional[int]:
  """The least power-of-two tp <= 64 at which weights and `batch` requests of
  `context` tokens fit every device (experts split ep ways); None if none does."""
  found = _first_fit(cfg, context, batch, [(tp, ep) for tp in _POWERS], kv_dtype,
                     weight_dtype, gpu_gib, reserve_gib, include_mtp, count_scales)
  return found and found[0]


def smallest_ep(cfg: ModelConfig, context: int, batch: int = 1, kv_dtype: str = "bf16",
                weight_dtype: str = "bf16", gpu_gib: float = 80.0, reserve_gib: float = 4.0,
                include_mtp: bool = False, count_scales: bool = False,
                tp: int = 1) -> Optional[int]:
  """The least power-of-two ep <= Ne at which it fits every device of a tp x ep mesh;
  None if none does (or the model has no experts)."""
  eps = [ep for ep in _POWERS + (128, 256) if ep <= cfg.num_experts]
  found = _first_fit(cfg, context, batch, [(tp, ep) for ep in eps], kv_dtype, weight_dtype,
                     gpu_gib, reserve_gib, include_mtp, count_scales)
  return found and found[1]


def tp_plan(cfg: ModelConfig, context: int, tp: int, batch: int = 1, kv_dtype: str = "bf16",
            weight_dtype: str = "bf16", gpu_gib: float = 80.0, reserve_gib: float = 4.0,
            include_mtp: bool = False, count_scales: bool = False, ep: int = 1) -> TPPlan:
  """Sizes one device of a tp-way (x ep-way) mesh; ValueError naming what does not split."""
  ledger.check_positive_int(context, "context")
  ledger.check_positive_int(batch, "batch")
  _check_sizing(cfg, tp, ep)
  if not _splits(cfg, tp, ep):
    raise ValueError(f"{cfg.name!r} does not split over tp={tp}: num_heads {cfg.num_heads}, "
                     f"intermediate_size {cfg.intermediate_size}, num_kv_heads "
                     f"{cfg.num_kv_heads} (stored {_stored_kv_heads(cfg, tp)})" + (
                         f", moe_intermediate_size {cfg.moe_intermediate_size}"
                         if cfg.num_experts else ""))
  gpu = ledger.gib_to_bytes(gpu_gib, "gpu_gib")
  reserve = ledger.gib_to_bytes(reserve_gib, "reserve_gib")
  if gpu == 0:
    raise ValueError(f"gpu_gib must be > 0, got {gpu_gib!r}")
  weights, per_request, free = _fits(cfg, context, batch, tp, ep, kv_dtype, weight_dtype, gpu,
                                     reserve, include_mtp, count_scales)
  per_token = kv_bytes_per_token_per_device(cfg, tp, kv_dtype, include_mtp, count_scales)
  one_copy = kv_bytes_per_token_per_device(cfg, 1, kv_dtype, include_mtp, count_scales)
  stored = _stored_kv_heads(cfg, tp)
  options = (kv_dtype, weight_dtype, gpu_gib, reserve_gib, include_mtp, count_scales)
  return TPPlan(
      preset=cfg.name, tp=tp, context=context, batch=batch, stored_kv_heads=stored,
      kv_replication=stored // cfg.num_kv_heads, weight_bytes_per_device=weights,
      kv_bytes_per_token_per_device=per_token,
      kv_replication_bytes_per_token=ep * tp * per_token - one_copy,
      kv_bytes_per_request_per_device=per_request, free_kv_bytes_per_device=free,
      max_concurrency=ledger.max_concurrency(free, per_request),
      fits=batch * per_request <= free,
      smallest_tp=smallest_tp(cfg, context, batch, *options, ep=ep), ep=ep,
      expert_bytes_per_device=expert_bytes_per_device(cfg, tp, weight_dtype, ep),
      smallest_ep=smallest_ep(cfg, context, batch, *options, tp=tp) if cfg.num_experts
      else None)
