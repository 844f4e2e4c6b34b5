"""Tiny random HF MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss), saved with
save_pretrained."""
from __future__ import annotations

import torch
import transformers

import kvjax

# Wide init so greedy argmax margins dwarf float32 rounding; 8 experts, top 2.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=None, pad_token_id=0, num_experts_per_tok=2,
               attn_implementation="eager")

FAMILIES = {
    # Every layer MoE, softmax top-2 renormalized; GQA 4/2.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_hidden_layers=2, num_key_value_heads=2, num_local_experts=8)),
    # Layer 1 dense (mlp_only_layers), top-2 weights NOT renormalized, q/k norm.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=8,
        moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
        norm_topk_prob=False)),
    # MLA; layer 0 dense, then sigmoid routing with a choice bias over 2 of 4 groups,
    # a shared expert, routed_scaling_factor 2.5.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True)),
    # Fused interleaved experts with biases and clamped SwiGLU (limit low enough that
    # the clamps bite), router bias, softmax over the top-2 logits; q/k/v/o biases,
    # learned sinks; sliding (window 8 < the prompts) / full layers alternating; YaRN
    # rope as gpt-oss ships it (factor 32 over 4096, truncate false).
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        intermediate_size=32, sliding_window=8, swiglu_limit=1.5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=4096))),
}


def _randomize(*tensors, std: float = 0.3):
  for tensor in tensors:
    tensor.copy_(std * torch.randn(tensor.shape))


def build(family: str, seed: int = 0, **overrides):
  """The HF model of `family` in eval mode; the biases HF inits to 0 random (DeepSeek-V3's
  choice bias, gpt-oss's attention and expert biases), gpt-oss's sinks large enough to
  matter."""
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**{**_COMMON, **extra, **overrides})).eval()
  with torch.no_grad():
    for layer in model.model.layers:
      gate = getattr(layer.mlp, "gate", None)
      if gate is not None and hasattr(gate, "e_score_correction_bias"):
        _randomize(gate.e_score_correction_bias)
      if family == "gpt_oss":
        attn, experts = layer.self_attn, layer.mlp.experts
        _randomize(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias,
                   layer.mlp.router.bias, experts.gate_up_proj_bias, experts.down_proj_bias)
        _randomize(attn.sinks, std=2.0)
  return model


def save_tiny(family: str, directory: str, seed: int = 0, **overrides):
  model = build(family, seed, **overrides)
  model.save_pretrained(directory)
  return model


PROMPTS = [[5, 17, 33, 2, 9, 44, 71], [3, 99, 12, 8, 61, 23, 5, 5, 90, 14, 2, 77, 31, 6, 15, 40,
                                       101, 7, 66], [120, 1, 50]]
NEW_TOKENS = 12


def pair_loader(tmp_path_factory):
  """family -> (HF model, the kvjax Model loaded from its save_pretrained directory), cached."""
  cache = {}

  def get(family):
    if family not in cache:
      directory = str(tmp_path_factory.mktemp(family))
      hf_model = save_tiny(family, directory)
      cache[family] = (hf_model, kvjax.load_checkpoint(directory))
    return cache[family]

  return get


def hf_greedy(hf_model, prompts, new_tokens):
  """HF's greedy continuation of each prompt alone."""
  out = []
  for prompt in prompts:
    with torch.no_grad():
      tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                 do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    out.append(tokens[0, len(prompt):].tolist())
  return out
