"""Named model shapes: the published configs of real checkpoints (config.json of each
release), the random-weight `tiny` the tests build, and kvjax's own byte-level default
model.  `get_preset(name)` -> its ModelConfig (kvjax/model/config.py)."""
from __future__ import annotations

import math

from kvjax.model.config import ModelConfig, RopeScaling, YarnScaling

__all__ = ["PRESETS", "get_preset"]


_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)



def _gpt_oss(size: str, num_layers: int, num_experts: int) -> ModelConfig:
  """gpt-oss-20b / -120b: every layer top-4 softmax-after-top-k over experts of width 2880
  with biases and clamped SwiGLU, learned attention sinks (the "+sinks" name selects
  that layer kind, kvjax/model/learned_sinks.py), sliding 128-token and full layers
  alternating, YaRN rope (factor 32 over 4,096 positions, not truncated), o_proj bias."""
  yarn = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0,
                     beta_slow=1.0, truncate=False, attention_factor=0.1 * math.log(32.0) + 1)
  return ModelConfig(
      name=f"gpt-oss-{size}+sinks", vocab_size=201088, hidden_size=2880,
      intermediate_size=2880, num_layers=num_layers, num_heads=64, num_kv_heads=8,
      head_dim=64, max_position_embeddings=131072, rope_theta=150000.0, rope_scaling=yarn,
      rms_norm_eps=1e-5, attention_bias=True, attention_out_bias=True,
      layer_windows=(128, None) * (num_layers // 2), eos_token_id=200002, pad_token_id=199999,
      num_experts=num_experts, num_experts_per_tok=4, moe_intermediate_size=2880,
      moe_softmax_after_topk=True, expert_activation="clamped_swiglu", swiglu_limit=7.0,
      swiglu_alpha=1.702, moe_bias=True)


# Published shapes of the real checkpoints (config.json of each release).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
    "llama2-7b": ModelConfig(
        name="llama2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2),
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_id=128001),
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
        rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=128000, eos_token_id=128001),
    "mistral-7b": ModelConfig(
        name="mistral-7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
        sliding_window=4096, bos_token_id=1, eos_token_id=2),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qk_norm=True, bos_token_id=151643, eos_token_id=151645),
    # 7B MHA (C4: 512 KiB/token): llama2-7b above.  DeepSeek LLM 67B is the
    # baseline of DeepSeek-V2's "93.3% less KV cache" (C6).
    "deepseek-llm-67b": ModelConfig(
        name="deepseek-llm-67b", vocab_size=102400, hidden_size=8192,
        intermediate_size=22016, num_layers=95, num_heads=64, num_kv_heads=8, head_dim=128,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=100000, eos_token_id=100001),
    # MLA: head_dim is the q/k head (qk_nope + qk_rope); its YaRN rope scaling (factor
    # 40 over 4096, with an mscale on the softmax scale MLA would need) is left out.
    "deepseek-v2": ModelConfig(
        name="deepseek-v2", vocab_size=102400, hidden_size=5120, intermediate_size=12288,
        num_layers=60, num_heads=128, num_kv_heads=128, head_dim=192,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
        attention_type="mla", kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, bos_token_id=100000, eos_token_id=100001,
        num_experts=160, num_shared_experts=2, num_experts_per_tok=6,
        moe_intermediate_size=1536, first_k_dense_layers=1),
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
        attention_type="mla", kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, bos_token_id=100000, eos_token_id=100001,
        num_experts=64, num_shared_experts=2, num_experts_per_tok=6,
        moe_intermediate_size=1408, first_k_dense_layers=1),
    # Mixture of experts (kvjax/moe/): Mixtral's top-2 of 8 experts in every layer.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True),
    # Qwen3-30B-A3B: top-8 of 128 experts of width 768 in all 48 layers.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qk_norm=True, bos_token_id=151643, eos_token_id=151645, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # DeepSeek-V3: MLA, 3 dense layers then 256 routed (top 8, sigmoid scores with a
    # choice bias, 4 of 8 groups) + 1 shared expert, one MTP module; YaRN left out
    # as for deepseek-v2.
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
        attention_type="mla", kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mtp_num_hidden_layers=1, bos_token_id=0,
        eos_token_id=1, num_experts=256, num_shared_experts=1, num_experts_per_tok=8,
        moe_intermediate_size=2048, first_k_dense_layers=3, moe_scoring="sigmoid",
        moe_score_bias=True, moe_num_groups=8, moe_topk_groups=4, norm_topk_prob=True,
        routed_scaling_factor=2.5),
    "gpt-oss-20b": _gpt_oss("20b", num_layers=24, num_experts=32),
    "gpt-oss-120b": _gpt_oss("120b", num_layers=36, num_experts=128),
    # Qwen3.5-9B text model: 32 layers laid out 8 x (3 Gated DeltaNet + 1 gated
    # full attention), full attention 16 q / 4 kv heads of head_dim 256 with a
    # sigmoid output gate and rope on the first quarter of each head.  Only the
    # 8 full-attention layers cache K/V: 2 x 8 x 4 x 256 x 2 B = 32,768 B = 32 KiB
    # per token, the formula the seed (C4) matched to its measured 32.3 KB; each
    # DeltaNet layer keeps a constant per-request state instead (kvjax/model/hybrid.py).
    # Runnable with random init; the vision tower is omitted.
    "qwen3.5-9b": ModelConfig(
        name="qwen3.5-9b", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256,
        max_position_embeddings=262144, rope_theta=10000000.0, rms_norm_eps=1e-6,
        qk_norm=True, mtp_num_hidden_layers=1, eos_token_id=248044,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 8,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel=4, attn_output_gate=True,
        partial_rotary_factor=0.25),
    # kvjax's built-in default model (kvjax/assets/default_model, MODEL_CARD.md):
    # byte-level stdlib Python LM with 2 MTP draft modules, trained by
    # `python -m experiments.train --config=configs/tiny_code.py`.  Small enough for
    # CPU tests (2.9M params); head_dim 64 as the Pallas kernels require.
    "tiny-code": ModelConfig(
        name="tiny-code", vocab_size=259, hidden_size=192, intermediate_size=512,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        mtp_num_hidden_layers=2, bos_token_id=256, eos_token_id=257, pad_token_id=258),
}


def get_preset(name: str) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name]
