"""The HF transformers peer on kvjax's own weights: a LlamaForCausalLM whose
tensors are the kvjax params' device buffers (DLPack, no host copy), and its
static-batch greedy generate.

  hf = to_hf_on_device(model)           # CPU arrays -> CPU torch, GPU -> CUDA
  ids = hf_generate(hf, prompts, 64, "static")   # "sdpa" | "static" | "compile"
"""
from __future__ import annotations

import jax.numpy as jnp




def to_hf_on_device(model):
  """LlamaForCausalLM whose tensors are the kvjax params' device buffers, rearranged
  on the device and shared through DLPack (no host copy): the inverse of
  kvjax/weights/hf.py's mapping."""
  import torch
  import transformers

  cfg, p = model.config, model.params
  unsupported = {name: getattr(cfg, name) for name in (
      "rope_scaling", "sliding_window", "attention_bias", "qk_norm")
      if getattr(cfg, name, None)}
  if cfg.attention_type != "gqa" or unsupported or p.mtp:
    raise ValueError(f"to_hf_on_device builds a plain Llama; {cfg.name} has "
                     f"attention_type={cfg.attention_type!r}, {unsupported}, "
                     f"{len(p.mtp)} MTP modules")
  hf_cfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
      rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
      tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
      pad_token_id=None, attn_implementation="sdpa", dtype=jnp.dtype(model.dtype).name)
  shared = lambda x: torch.from_dlpack(jnp.asarray(x))
  d = cfg.hidden_size
  state = {"model.embed_tokens.weight": shared(p.embed), "model.norm.weight": shared(p.final_norm)}
  if not cfg.tie_word_embeddings:
    state["lm_head.weight"] = shared(p.lm_head.T)
  for i, b in enumerate(p.blocks):
    pre = f"model.layers.{i}."
    state.update({
        pre + "input_layernorm.weight": shared(b.attn_norm),
        pre + "post_attention_layernorm.weight": shared(b.mlp_norm),
        pre + "self_attn.q_proj.weight": shared(b.attn.wq.reshape(d, -1).T),
        pre + "self_attn.k_proj.weight": shared(b.attn.wk.reshape(d, -1).T),
        pre + "self_attn.v_proj.weight": shared(b.attn.wv.reshape(d, -1).T),
        pre + "self_attn.o_proj.weight": shared(b.attn.wo.reshape(-1, d).T),
        pre + "mlp.gate_proj.weight": shared(b.w_gate.T),
        pre + "mlp.up_proj.weight": shared(b.w_up.T),
        pre + "mlp.down_proj.weight": shared(b.w_down.T)})
  device = next(iter(state.values())).device
  with torch.device("meta"):
    hf = transformers.LlamaForCausalLM(hf_cfg)
  hf.load_state_dict(state, strict=True, assign=True)
  if cfg.tie_word_embeddings:
    hf.tie_weights()
  # Non-persistent buffers (rope frequencies) are not in the state dict: build them for real.
  hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)
  return hf.eval()


def hf_generate(hf, prompts, new_tokens: int, mode: str):
  """Left-padded static batch, exactly new_tokens greedy tokens each -> host ids [B, new]."""
  import torch

  device = hf.model.embed_tokens.weight.device
  width = max(map(len, prompts))
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for j, prompt in enumerate(prompts):
    ids[j, width - len(prompt):] = torch.tensor(prompt)
    mask[j, width - len(prompt):] = 1
  options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                 pad_token_id=0)
  if mode != "sdpa":  # a static cache; transformers compiles its forward unless disabled
    options.update(cache_implementation="static", disable_compile=mode == "static")
  with torch.inference_mode():
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), **options)
  return out[:, width:].cpu()


