"""Memory ledger: KV-cache, weight and concurrency arithmetic from a ModelConfig.

Claims C4-C6 are arithmetic, so they live here as pure Python over
`ModelConfig` (no JAX, no allocation): a planner must be able to size a card for
a 236B model on a laptop.

What a token costs is read from the KV layout's own array specs
(kvjax/caches/layout.py; no second formula): GQA/MHA/MQA float pages hold K and
V, `2 * K * H` values per layer; MLA's latent pages hold one latent plus the
decoupled rope key, `kv_lora_rank + qk_rope_head_dim` values per layer.  Hybrid
models cache only their `num_full_attention_layers`; linear-attention layers keep
a fixed-size state that does not grow with context: not a per-token cost, but a
constant per request (`state_bytes_per_request`, kvjax/caches/recurrent.py's
`state_arrays`), as is any other per-slot array of a layout (int4's residual).
A sliding-window layer holds at most `window` tokens, so `kv_bytes_per_request`
caps it while `kv_bytes_per_token` (the seed's per-token figure) does not; a
layout that releases pages itself (attention sinks + window) holds what its
page manager keeps.

Quantized KV.  int8 is 1 and int4 1/2 byte per value: the ideal 2x and 4x of
claim C6.  A real quantized cache also stores scales, the layout's arrays marked
`scales`: int8 one float32 per token, layer, kv head and K or V; int4 (KIVI) a
float32 scale and offset per token for values and per channel per page for keys
(sized at the Engine's default `PAGE_SIZE`).  Scales are reported separately and enter a
plan's per-request bytes only with `count_scales=True`, so the default
reproduces the seed's ideal ratios.

Units.  Functions return bytes.  KiB and GiB are binary.  The seeds write "GB"
loosely, but their KV arithmetic is binary (128 KiB x 4096 = 0.5 GiB exactly;
60 / 0.5 = 120 requests), so kvjax reads a seed's "GB" of cache or of card
budget as GiB, and `--gpu-gib 80 --weight-gib 16 --reserve-gib 4` reproduces
C5 exactly.  The seeds' weight sizes are nominal (parameters in the model's name
times bytes: 8B x 2 = 16 GB, 70B x 0.5 = 35 GB, 7B x 2 B = 13.04 GiB); the ledger
counts parameters from the config instead, and the experiment prints both.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional

from kvjax.caches.groups import layer_groups
from kvjax.caches.layout import FLOAT_STORES, PoolSizes, sizing_layout
from kvjax.caches.recurrent import state_arrays
from kvjax.engine.sched.mask_release import mask_release
from kvjax.model.config import ModelConfig, short_dtype_name
from kvjax.model.layer_kinds import layer_kind
from kvjax.model.learned_sinks import LEARNED_SINKS

__all__ = ["KIB", "GIB", "DTYPE_BITS", "PAGE_SIZE", "MemoryPlan", "bytes_for",
           "kv_values_per_token", "kv_bytes_per_token", "kv_scale_bytes_per_token",
           "kv_bytes_per_request", "slot_bytes_per_request", "state_bytes_per_request",
           "param_count", "weight_bytes", "max_concurrency",
           "plan", "check_dtype", "check_positive_int", "gib_to_bytes"]

KIB, GIB = 1 << 10, 1 << 30

# Storage width of one weight value; int4 packs two values per byte.
DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}
PAGE_SIZE = 16  # the Engine's default page_size: sizes per-page scales and int4's residual


def check_dtype(dtype: str, what: str) -> int:
  dtype = short_dtype_name(dtype)
  if dtype not in DTYPE_BITS:
    raise ValueError(f"unsupported {what} dtype {dtype!r}; use one of {sorted(DTYPE_BITS)}")
  return DTYPE_BITS[dtype]


def check_positive_int(value, name: str) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def bytes_for(num_values: int, dtype: str) -> int:
  """Bytes to store `num_values` values of `dtype` (int4 rounds up to whole bytes)."""
  return -(-num_values * check_dtype(dtype, "value") // 8)


def _cache_layer_windows(cfg: ModelConfig, include_mtp: bool) -> list:
  """Window (None = unbounded) of every layer that holds a KV cache."""
  if cfg.num_full_attention_layers is not None:
    windows = [None] * cfg.num_full_attention_layers
  else:
    windows = [cfg.window_of_layer(i) for i in range(cfg.num_layers)]
  if include_mtp:
    windows += [cfg.window_of_layer(cfg.num_layers + j)
                for j in range(cfg.mtp_num_hidden_layers)]
  return windows


def _whole(x: Fraction):
  return int(x) if x.denominator == 1 else float(x)


def _per_layer_token(cfg: ModelConfig, kv_dtype, scales: bool = False) -> Fraction:
  return sizing_layout(kv_dtype, cfg).bytes_per_layer_token(cfg, PAGE_SIZE, scales)


def kv_values_per_token(cfg: ModelConfig, include_mtp: bool = False) -> int:
  """Cached values per token of history, over every cache layer (C4's formula): the
  default layout's page values."""
  per_layer = sizing_layout(None, cfg).values_per_layer_token(cfg, PAGE_SIZE)
  return _whole(len(_cache_layer_windows(cfg, include_mtp)) * per_layer)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16",
                       include_mtp: bool = False) -> int:
  """Ideal KV bytes per token (values only, no quantization scales)."""
  return _whole(len(_cache_layer_windows(cfg, include_mtp)) * _per_layer_token(cfg, kv_dtype))


def kv_scale_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bf16",
                             include_mtp: bool = False) -> int:
  """Bytes of quantization scales per token; 0 for float caches."""
  layers = len(_cache_layer_windows(cfg, include_mtp))
  return _whole(layers * _per_layer_token(cfg, kv_dtype, scales=True))


def kv_bytes_per_request(cfg: ModelConfig, context: int, kv_dtype: str = "bf16",
                         include_mtp: bool = False, count_scales: bool = False) -> int:
  """KV bytes one request of `context` tokens holds: each windowed layer caps it, and
  pages a monotone attention variant hides (cfg's, or an alias kv_dtype's such as
  "streaming": sinks + window) are released as the engine releases them."""
  check_positive_int(context, "context")
  layout = sizing_layout(kv_dtype, cfg)
  release = mask_release(layout.page_release(PAGE_SIZE, None), layout.serving_config(cfg),
                         draft=None)
  held = context - PAGE_SIZE * len(release.dead_pages(context))
  tokens = sum(held if w is None else min(held, w)
               for w in _cache_layer_windows(cfg, include_mtp))
  per_token = _per_layer_token(cfg, kv_dtype) + (
      _per_layer_token(cfg, kv_dtype, scales=True) if count_scales else 0)
  return _whole(tokens * per_token)


def kv_group_bytes_per_request(cfg: ModelConfig, context: int, kv_dtype: str = "bf16",
                               page_size: int = PAGE_SIZE,
                               max_num_batched_tokens: int = 1) -> int:
  """KV page bytes one request of `context` tokens (prompt + new) holds at most with one
  pool per KV layer group (kvjax/caches/groups.py, EngineConfig.kv_groups): each group's
  layers times its pages at its release bound (a sliding group's ceil((window + n - 2) / Z)
  + 1 for rows of n <= max_num_batched_tokens positions, a global group's every page), at
  the layout's bytes per page."""
  check_positive_int(context, "context")
  layout = sizing_layout(kv_dtype, cfg)
  page_bytes = layout.bytes_per_layer_token(cfg, page_size) * page_size
  return _whole(sum(
      len(group.layers) * page_bytes * layout.page_release(page_size, group.window)
      .max_pages_held(context, max_num_batched_tokens) for group in layer_groups(cfg)))


def slot_bytes_per_request(cfg: ModelConfig, kv_dtype: str = "bf16",
                           state_dtype: str = "bf16") -> int:
  """Bytes one request's slot holds whatever its length: the layout's per-slot arrays
  (int4's residual at `state_dtype`, the model's) plus a hybrid's recurrent state."""
  return sizing_layout(kv_dtype, cfg).slot_bytes(cfg, PAGE_SIZE, state_dtype) + \
      state_bytes_per_request(cfg, state_dtype)


def state_bytes_per_request(cfg: ModelConfig, state_dtype: str = "bf16") -> int:
  """Recurrent state one request holds whatever its length (0 for non-hybrids):
  conv states at `state_dtype` (the model's) plus float32 delta-rule states."""
  if not cfg.is_hybrid:
    return 0
  return sum(a.nbytes for a in state_arrays(cfg, state_dtype, PoolSizes(0, 1, 1)).values()
             if a.role == "slot")


def _linear_channels(cfg: ModelConfig) -> int:
  """Conv channels X of a Gated DeltaNet layer: q and k (Nk x Hk each), v (Nv x Hv)."""
  return (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
          + cfg.linear_num_value_heads * cfg.linear_value_head_dim)


def _gated_delta_params(cfg: ModelConfig) -> int:
  """in_proj_qkv, z, b, a; conv; dt_bias, A_log; gated norm; out_proj."""
  d, nv, hv, x = (cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                  _linear_channels(cfg))
  return (d * x + d * nv * hv + 2 * d * nv + cfg.linear_conv_kernel * x + 2 * nv + hv
          + nv * hv * d)


def _attention_params(cfg: ModelConfig) -> int:
  d, n = cfg.hidden_size, cfg.num_heads
  if cfg.attention_type == "mla":
    qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:  # q_a_proj, its norm, q_b_proj.
      q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * n * qk_dim
    else:
      q = d * n * qk_dim
    kv_a = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank  # + norm.
    kv_b = cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv_a + kv_b + n * cfg.v_head_dim * d
  k, h = cfg.num_kv_heads, cfg.head_dim
  total = d * n * h + 2 * d * k * h + n * h * d
  if cfg.attention_bias:
    total += (n + 2 * k) * h
  if cfg.attention_out_bias:
    total += d
  if cfg.qk_norm:
    total += 2 * h
  if cfg.attn_output_gate:
    total += d * n * h
  return total


def _block_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
  """One block's parameters (`active`: those one token reads, its top-k experts only)."""
  d = cfg.hidden_size
  if cfg.is_moe_layer(layer):
    routed = cfg.num_experts_per_tok if active else cfg.num_experts
    experts = routed + cfg.num_shared_experts
    mlp = experts * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts  # + router.
    if cfg.moe_bias:  # the router's and each routed expert's gate, up and down biases
      mlp += cfg.num_experts + routed * (2 * cfg.moe_intermediate_size + d)
  else:
    mlp = 3 * d * cfg.intermediate_size  # gate, up, down.
  mixer = _gated_delta_params(cfg) if cfg.is_linear_layer(layer) else _attention_params(cfg)
  if layer_kind(cfg, layer) is LEARNED_SINKS:
    mixer += cfg.num_heads
  return 2 * d + mixer + mlp  # two RMSNorms.


def param_count(cfg: ModelConfig, active: bool = False) -> int:
  """Parameters of the checkpoint described by `cfg`, MTP modules included (`active`:
  only those one token's forward reads, an MoE layer's chosen experts).

  Hybrids with `layer_types` count their Gated DeltaNet layers as such; a
  ledger-only hybrid (just num_full_attention_layers) counts every layer as
  attention of the configured shape.
  """
  d, v = cfg.hidden_size, cfg.vocab_size
  total = v * d * (1 if cfg.tie_word_embeddings else 2) + d  # + final norm.
  total += sum(_block_params(cfg, i, active) for i in range(cfg.num_layers))
  # Each MTP module: two input norms, a [2D, D] projection, one block, an output norm.
  mtp_block = _block_params(cfg, cfg.num_layers, active)
  total += cfg.mtp_num_hidden_layers * (3 * d + 2 * d * d + mtp_block)
  return total


def weight_bytes(cfg: ModelConfig, weight_dtype: str = "bf16") -> int:
  """Bytes of all parameters stored as `weight_dtype` (quantization scales excluded)."""
  check_dtype(weight_dtype, "weight")
  return bytes_for(param_count(cfg), weight_dtype)


def max_concurrency(free_bytes: int, bytes_per_request: int) -> int:
  """Requests whose caches fit in `free_bytes` at once (0 if none)."""
  return max(0, free_bytes // bytes_per_request)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """One sizing question answered: what a request costs and how many fit."""

  preset: str
  context: int
  batch: int  # target concurrency for `total_bytes`.
  kv_dtype: str
  weight_dtype: str
  kv_bytes_per_token: int  # ideal, values only.
  kv_scale_bytes_per_token: int  # quantization scales, reported separately.
  kv_bytes_per_request: int  # scales included only if count_scales.
  state_bytes_per_request: int  # per-slot state (recurrent, int4 residual), constant.
  scales_counted: bool
  param_count: int
  weight_bytes: int  # computed from param_count, or --weight-gib.
  gpu_bytes: int
  reserve_bytes: int
  free_kv_bytes: int  # gpu - weights - reserve (negative: weights do not fit).
  max_concurrency: int
  total_bytes: int  # weights + batch * kv_bytes_per_request + reserve.
  fits: bool  # total_bytes <= gpu_bytes.


def gib_to_bytes(value: float, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
    raise ValueError(f"{name} must be a number >= 0, got {value!r}")
  return round(value * GIB)


def plan(cfg: ModelConfig, context: int, batch: int = 1, kv_dtype: str = "bf16",
         weight_dtype: str = "bf16", weight_gib: Optional[float] = None,
         gpu_gib: float = 80.0, reserve_gib: float = 4.0, include_mtp: bool = False,
         count_scales: bool = False) -> MemoryPlan:
  """Sizes weights plus `batch` requests of `context` tokens on a `gpu_gib` card."""
  check_positive_int(context, "context")
  check_positive_int(batch, "batch")
  check_dtype(weight_dtype, "weight")
  per_request = kv_bytes_per_request(cfg, context, kv_dtype, include_mtp, count_scales)
  state = slot_bytes_per_request(cfg, kv_dtype, weight_dtype if weight_dtype in FLOAT_STORES
                                 else "bf16")  # slot state: the float model dtype
  weights = (weight_bytes(cfg, weight_dtype) if weight_gib is None
             else gib_to_bytes(weight_gib, "weight_gib"))
  gpu = gib_to_bytes(gpu_gib, "gpu_gib")
  if gpu == 0:
    raise ValueError(f"gpu_gib must be > 0, got {gpu_gib!r}")
  reserve = gib_to_bytes(reserve_gib, "reserve_gib")
  free = gpu - weights - reserve
  total = weights + batch * (per_request + state) + reserve
  return MemoryPlan(
      preset=cfg.name, context=context, batch=batch, kv_dtype=kv_dtype,
      weight_dtype=weight_dtype,
      kv_bytes_per_token=kv_bytes_per_token(cfg, kv_dtype, include_mtp),
      kv_scale_bytes_per_token=kv_scale_bytes_per_token(cfg, kv_dtype, include_mtp),
      kv_bytes_per_request=per_request, state_bytes_per_request=state,
      scales_counted=count_scales,
      param_count=param_count(cfg), weight_bytes=weights, gpu_bytes=gpu,
      reserve_bytes=reserve, free_kv_bytes=free,
      max_concurrency=max_concurrency(free, per_request + state), total_bytes=total,
      fits=total <= gpu)
