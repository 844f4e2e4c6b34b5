"""Model configuration: one frozen, hashable dataclass for every decoder family.

`ModelConfig` is static under `jax.jit` (it is hashable), so a step compiled for
one config never silently serves another.  The same dataclass describes Llama 2/3
(incl. Llama-3.1 rope scaling), Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm, free head_dim), Gemma 3 (local / global layers with their
own rope bases, norms after each sublayer too, scaled embeddings, GeGLU),
DeepSeek-style MLA and hybrid models (the
ledger counts only full-attention layers), plus kvjax's own byte-level code model
with MTP draft heads.

Dimension legend used across kvjax (einsum strings and shape comments):
  B batch rows, T query tokens per row, S kv tokens, N q heads, K kv heads,
  H head_dim, D model dim, F mlp dim, V vocab, P pages, G page size, L layers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["RopeScaling", "YarnScaling", "ModelConfig", "DTYPE_SHORT_NAMES",
           "short_dtype_name", "LAYER_TYPES"]

# One dtype vocabulary for weights (`dtype`, --dtype) and KV pages (`kv_dtype`,
# --kv-dtype): both accept either spelling; the short one is what results, the
# ledger and error messages print.
DTYPE_SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
LAYER_TYPES = ("full_attention", "linear_attention")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation: SwiGLU, GeGLU (tanh GELU)
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")
GROUPED_MATMUL_NAMES = ("xla", "tokamax")  # kvjax/moe/grouped_matmul.py's record names


def short_dtype_name(name):
  """'bfloat16' -> 'bf16'; short names, int8/int4 and None pass through."""
  return DTYPE_SHORT_NAMES.get(name, name) if isinstance(name, str) else name


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3.1 style frequency-dependent rope scaling (HF rope_type='llama3')."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN rope scaling (HF rope_type='yarn', gpt-oss): frequencies interpolated by
  `factor` below the `beta_slow` .. `beta_fast` rotation band, kept above it, ramped
  between (the band's ends floored / ceiled when `truncate`); cos and sin scaled by
  `attention_factor` (kvjax/model/layers.py)."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and variants of a decoder-only transformer.

  Attention variants: `num_kv_heads == num_heads` is MHA, `1` is MQA, anything
  between is GQA.  `sliding_window` applies to every layer unless
  `layer_windows` gives one entry per layer (None = full attention), as in
  models that interleave local and global layers.
  """

  name: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  max_position_embeddings: int
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling | YarnScaling] = None
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: bias on q, k, v projections.
  attention_out_bias: bool = False  # gpt-oss: bias on the o projection too.
  qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before rope.
  sliding_window: Optional[int] = None
  layer_windows: Optional[tuple] = None  # per-layer window (None entries = full).
  layer_rope_thetas: Optional[tuple] = None  # per-layer rope base (None entries = rope_theta)
  # Gemma 2/3: the attention and MLP outputs are RMS-normed too before the residual add
  # (BlockParams.post_attn_norm / post_mlp_norm).
  post_norms: bool = False
  scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), at their dtype
  mlp_activation: str = "silu"  # one of MLP_ACTIVATIONS
  # Gemma: q . k scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
  query_pre_attn_scalar: Optional[float] = None

  # An attention variant (kvjax/attention/variants.py: mask and score over positions) for
  # every layer, or a tuple of one per cache layer (None entries = none); set through
  # kvjax's `attention=` (variants.with_attention), not saved with a checkpoint.
  attention_variant: Any = None
  mtp_num_hidden_layers: int = 0  # DeepSeek-V3 style MTP draft modules.
  # Multi-head latent attention (DeepSeek-V2/V3); attention_type "mla".
  attention_type: str = "gqa"
  kv_lora_rank: int = 0
  q_lora_rank: Optional[int] = None
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # Hybrid models: layers with no KV cache (linear attention / state space).
  # Ledger-only presets give just the count; runnable hybrids give `layer_types`
  # ("full_attention" | "linear_attention" per layer) and the count follows.
  num_full_attention_layers: Optional[int] = None
  layer_types: Optional[tuple] = None
  # Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention; kvjax/model/hybrid.py).
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel: int = 4
  linear_chunk_size: int = 64  # static chunk length of the chunked prefill
  # Gated full attention (Qwen3.5): a sigmoid output gate per q head, rope on the
  # first `partial_rotary_factor` of each head.
  attn_output_gate: bool = False
  partial_rotary_factor: float = 1.0
  bos_token_id: Optional[int] = None
  eos_token_id: Optional[int] = None
  pad_token_id: Optional[int] = None
  # Mixture of experts (kvjax/moe/): MoE layers (`is_moe_layer`) replace the dense MLP
  # with `num_experts` routed experts, `num_experts_per_tok` chosen per token, plus
  # `num_shared_experts` always-on ones, each of width `moe_intermediate_size`; 0
  # experts = dense model.  Dense layers: the first `first_k_dense_layers`
  # (DeepSeek), `mlp_only_layers` and those off every `moe_layer_step`-th (Qwen).
  num_experts: int = 0
  num_shared_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  first_k_dense_layers: int = 0
  moe_layer_step: int = 1  # HF decoder_sparse_step
  mlp_only_layers: tuple = ()
  # Routing (kvjax/moe/routing.py): "softmax" probabilities then top-k (Mixtral, Qwen),
  # or "sigmoid" scores with a per-expert choice bias (DeepSeek-V3's
  # e_score_correction_bias) and group-limited choice: the `moe_topk_groups` best of
  # `moe_num_groups` expert groups; `moe_softmax_after_topk`: softmax over the top-k
  # logits only (gpt-oss).  `norm_topk_prob` renormalizes the k weights to sum 1;
  # `routed_scaling_factor` scales them.
  moe_scoring: str = "softmax"
  moe_softmax_after_topk: bool = False
  moe_score_bias: bool = False
  moe_num_groups: int = 1
  moe_topk_groups: int = 1
  norm_topk_prob: bool = False
  routed_scaling_factor: float = 1.0
  # Experts (kvjax/moe/activation.py): "swiglu" silu(gate) * up, or gpt-oss's
  # "clamped_swiglu": gate clamped above and up on both sides at `swiglu_limit`, then
  # (up + 1) * gate * sigmoid(swiglu_alpha * gate).  `moe_bias`: the router and every
  # expert projection add a bias (gpt-oss).
  expert_activation: str = "swiglu"
  swiglu_limit: float = 7.0
  swiglu_alpha: float = 1.702
  moe_bias: bool = False
  # The grouped expert path's ragged matmul, by name (kvjax/moe/grouped_matmul.py):
  # "xla" (jax.lax.ragged_dot) or "tokamax" (its GPU kernels; the optional "gpu" extra).
  moe_grouped_matmul: str = "xla"

  def __post_init__(self):
    # A config read back from JSON holds lists; steps hash the config, so tuples.
    object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
    for field in ("layer_windows", "layer_rope_thetas"):
      if getattr(self, field) is not None:
        object.__setattr__(self, field, tuple(getattr(self, field)))
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.attention_type not in ("gqa", "mla"):
      raise ValueError(f"unknown attention_type {self.attention_type!r}; use 'gqa' or 'mla'")
    for field in ("layer_windows", "layer_rope_thetas"):
      if getattr(self, field) is not None and len(getattr(self, field)) != self.num_layers:
        raise ValueError(f"{field} has {len(getattr(self, field))} entries for "
                         f"{self.num_layers} layers")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"unknown mlp_activation {self.mlp_activation!r}; use one of "
                       f"{MLP_ACTIVATIONS}")
    if self.mtp_num_hidden_layers < 0:
      raise ValueError(f"mtp_num_hidden_layers must be >= 0, got {self.mtp_num_hidden_layers}")
    if self.layer_types is not None:
      self._check_layer_types()
    if self.num_experts:
      self._check_moe()

  def _check_moe(self):
    """Expert counts, router and group layout that a top-k choice can satisfy."""
    ne, ke, groups = self.num_experts, self.num_experts_per_tok, self.moe_num_groups
    for field in ("num_experts_per_tok", "moe_intermediate_size", "moe_layer_step",
                  "moe_num_groups", "moe_topk_groups"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{field} must be a positive int for an MoE model "
                         f"(num_experts={ne}), got {value!r}")
    if self.moe_scoring not in ("softmax", "sigmoid"):
      raise ValueError(f"unknown moe_scoring {self.moe_scoring!r}; use 'softmax' or 'sigmoid'")
    if self.expert_activation not in EXPERT_ACTIVATIONS:
      raise ValueError(f"unknown expert_activation {self.expert_activation!r}; use one of "
                       f"{EXPERT_ACTIVATIONS}")
    if self.moe_grouped_matmul not in GROUPED_MATMUL_NAMES:
      raise ValueError(f"unknown moe_grouped_matmul {self.moe_grouped_matmul!r}; use one of "
                       f"{GROUPED_MATMUL_NAMES}")
    if ne % groups or not self.moe_topk_groups <= groups or (groups > 1 and ne // groups < 2):
      raise ValueError(f"num_experts={ne} does not split into moe_num_groups={groups} groups "
                       f"of >= 2 experts with moe_topk_groups={self.moe_topk_groups} <= groups")
    if not ke <= self.moe_topk_groups * ne // groups:
      raise ValueError(f"num_experts_per_tok={ke} exceeds the {self.moe_topk_groups * ne // groups}"
                       f" experts that moe_topk_groups={self.moe_topk_groups} groups hold")

  def is_moe_layer(self, layer: int) -> bool:
    """Layer `layer` (MTP blocks count from num_layers) has routed experts, not a dense MLP."""
    return (self.num_experts > 0 and layer >= self.first_k_dense_layers
            and layer not in self.mlp_only_layers and (layer + 1) % self.moe_layer_step == 0)

  def _check_layer_types(self):
    """Hybrid layout: one known type per layer, the full-attention count agrees."""
    types = tuple(self.layer_types)
    if len(types) != self.num_layers:
      raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
      raise ValueError(f"unknown layer_types {unknown}; use {LAYER_TYPES}")
    full = types.count("full_attention")
    if self.num_full_attention_layers not in (None, full):
      raise ValueError(f"num_full_attention_layers={self.num_full_attention_layers} but "
                       f"layer_types has {full} full_attention layers")
    object.__setattr__(self, "layer_types", types)  # hashable even when given a list
    object.__setattr__(self, "num_full_attention_layers", full)
    if "linear_attention" in types:
      for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel", "linear_chunk_size"):
        value = getattr(self, field)
        if not isinstance(value, int) or value <= 0:
          raise ValueError(f"ModelConfig.{field} must be a positive int for linear_attention "
                           f"layers, got {value!r}")
      if self.linear_num_value_heads % self.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a "
                         f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must give an even "
                       f"rotary dim in (0, head_dim={self.head_dim}], got {self.rotary_dim}")

  @property
  def is_hybrid(self) -> bool:
    """Some layers keep a recurrent state instead of KV (runnable hybrids only)."""
    return self.layer_types is not None and "linear_attention" in self.layer_types

  def is_linear_layer(self, layer: int) -> bool:
    """Layer `layer` (MTP blocks count from num_layers) is a Gated DeltaNet layer."""
    return self.is_hybrid and layer < self.num_layers and \
        self.layer_types[layer] == "linear_attention"

  @property
  def num_linear_layers(self) -> int:
    return self.layer_types.count("linear_attention") if self.is_hybrid else 0

  def state_index(self, layer: int) -> int:
    """Index of layer `layer` among its kind's cache rows: linear layers among the
    linear layers (recurrent state), attention layers among the KV layers (MTP
    blocks after the trunk's)."""
    if not self.is_hybrid:
      return layer
    kinds = self.layer_types[:min(layer, self.num_layers)]
    if self.is_linear_layer(layer):
      return kinds.count("linear_attention")
    return kinds.count("full_attention") + max(0, layer - self.num_layers)

  @property
  def rotary_dim(self) -> int:
    """Leading dims of each head that rope rotates (the rest pass through)."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def num_queries_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def num_cache_layers(self) -> int:
    """Layers that own KV pages when drafting with MTP: the trunk plus every MTP block."""
    return self.cache_layers(with_mtp=True)

  def cache_layers(self, with_mtp: bool) -> int:
    """KV layers a cache allocates: MTP modules' only when they draft (claim C11's cost);
    a hybrid's linear layers hold none."""
    trunk = self.num_layers - self.num_linear_layers
    return trunk + (self.mtp_num_hidden_layers if with_mtp else 0)

  def window_of_layer(self, layer: int) -> Optional[int]:
    """Sliding window of cache layer `layer` (MTP blocks use the global window)."""
    if self.layer_windows is not None and layer < self.num_layers:
      return self.layer_windows[layer]
    return self.sliding_window

  def rope_theta_of_layer(self, layer: int) -> float:
    """Rope base of layer `layer` (MTP blocks use the global base)."""
    if self.layer_rope_thetas is not None and layer < self.num_layers:
      theta = self.layer_rope_thetas[layer]
      return self.rope_theta if theta is None else theta
    return self.rope_theta

  @property
  def attention_scale(self) -> float:
    """The softmax scale of q . k."""
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def variant_of_layer(self, layer: int):
    """The attention variant of cache layer `layer`, or None."""
    if isinstance(self.attention_variant, tuple):
      return self.attention_variant[layer] if layer < len(self.attention_variant) else None
    return self.attention_variant

  @property
  def variant_names(self) -> tuple:
    """Names of the attention variants any cache layer applies (empty: none)."""
    variants = [self.variant_of_layer(layer) for layer in range(self.num_cache_layers)]
    return tuple(dict.fromkeys(v.name for v in variants if v is not None))

  @property
  def kv_window(self) -> Optional[int]:
    """Widest window over every cache layer; None if one attends to the whole prefix."""
    windows = [self.window_of_layer(layer) for layer in range(self.num_cache_layers)]
    return None if None in windows else max(windows)

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)
