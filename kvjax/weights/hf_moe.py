"""HF mixture-of-experts checkpoints: config fields, tensor names and MoEParams.

  mixtral      block_sparse_moe.gate [Ne, D]; experts.{e}.w1 (gate), w3 (up) [Fe, D],
               w2 (down) [D, Fe]; every layer MoE; softmax, top-k renormalized.
  qwen3_moe    mlp.gate; mlp.experts.{e}.{gate,up,down}_proj; dense layers off every
               decoder_sparse_step-th and in mlp_only_layers; norm_topk_prob.
  deepseek_v3  as qwen3_moe plus mlp.gate.e_score_correction_bias [Ne] and
               mlp.shared_experts.* of width n_shared_experts Fe; dense before
               first_k_dense_replace; sigmoid, group-limited, routed_scaling_factor.
  gpt_oss      mlp.router.{weight [Ne, D], bias [Ne]}; experts fused across Ne:
               gate_up_proj [Ne, D, 2 Fe] input-major with gate and up INTERLEAVED
               (gate the even columns, up the odd), gate_up_proj_bias [Ne, 2 Fe],
               down_proj [Ne, Fe, D], down_proj_bias [Ne, D]; every layer MoE;
               softmax over the top-k logits; clamped SwiGLU (kvjax/moe/activation.py).
Torch [out, in] projections are transposed to kvjax's input-major layout; gpt-oss's
fused experts are split into one ExpertParams each, gate and up de-interleaved.
"""
from __future__ import annotations

from typing import Any, Callable

from kvjax.model.config import ModelConfig
from kvjax.moe.params import ExpertParams, MoEParams

__all__ = ["MOE_MODEL_TYPES", "moe_config", "moe_tensors", "moe_params"]

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "gpt_oss")  # deepseek_v3: the DeepSeek path


def moe_config(hf: dict[str, Any]) -> dict[str, Any]:
  """ModelConfig's MoE fields from an HF config.json dict ({} for a dense model)."""
  model_type = hf.get("model_type")
  if model_type == "mixtral":
    return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
  if model_type == "qwen3_moe":
    return dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                moe_layer_step=hf.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
  if model_type == "deepseek_v3" and hf.get("n_routed_experts"):
    return dict(num_experts=hf["n_routed_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                num_shared_experts=hf.get("n_shared_experts") or 0,
                moe_intermediate_size=hf["moe_intermediate_size"],
                first_k_dense_layers=hf.get("first_k_dense_replace") or 0,
                moe_scoring="sigmoid", moe_score_bias=True,
                moe_num_groups=hf.get("n_group") or 1, moe_topk_groups=hf.get("topk_group") or 1,
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
  if model_type == "gpt_oss":
    return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], moe_softmax_after_topk=True,
                expert_activation="clamped_swiglu", swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), moe_bias=True)
  return {}


def _names(model_type: str, pre: str) -> tuple[str, str, tuple[str, str, str]]:
  """(router name, expert e's name prefix with {e}, (gate, up, down) suffixes)."""
  if model_type == "mixtral":
    return pre + "block_sparse_moe.gate.weight", pre + "block_sparse_moe.experts.{e}.", (
        "w1.weight", "w3.weight", "w2.weight")
  return pre + "mlp.gate.weight", pre + "mlp.experts.{e}.", (
      "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _fused_tensors(cfg: ModelConfig, pre: str) -> dict[str, tuple]:
  """gpt-oss: the router with its bias and the experts fused across Ne."""
  d, fe, ne = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
  at = pre + "mlp.experts."
  return {pre + "mlp.router.weight": (ne, d), pre + "mlp.router.bias": (ne,),
          at + "gate_up_proj": (ne, d, 2 * fe), at + "gate_up_proj_bias": (ne, 2 * fe),
          at + "down_proj": (ne, fe, d), at + "down_proj_bias": (ne, d)}


def _fused_params(cfg: ModelConfig, get: Callable[[str], Any], pre: str) -> MoEParams:
  """gpt-oss's fused experts, one ExpertParams each; gate_up's even columns are the
  gate, its odd ones up (HF's gate_up[..., ::2], gate_up[..., 1::2])."""
  at = pre + "mlp.experts."
  gate_up, gate_up_bias = get(at + "gate_up_proj"), get(at + "gate_up_proj_bias")
  down, down_bias = get(at + "down_proj"), get(at + "down_proj_bias")
  experts = tuple(ExpertParams(
      w_gate=gate_up[e, :, 0::2], w_up=gate_up[e, :, 1::2], w_down=down[e],
      b_gate=gate_up_bias[e, 0::2], b_up=gate_up_bias[e, 1::2], b_down=down_bias[e])
      for e in range(cfg.num_experts))
  return MoEParams(router=get(pre + "mlp.router.weight").T,
                   router_bias=get(pre + "mlp.router.bias"), experts=experts)


def moe_tensors(cfg: ModelConfig, model_type: str, pre: str) -> dict[str, tuple]:
  """name -> torch shape of every tensor of MoE layer `pre` (hf_contract's check)."""
  if model_type == "gpt_oss":
    return _fused_tensors(cfg, pre)
  d, fe = cfg.hidden_size, cfg.moe_intermediate_size
  router, expert, (gate, up, down) = _names(model_type, pre)
  out = {router: (cfg.num_experts, d)}
  for e in range(cfg.num_experts):
    at = expert.format(e=e)
    out.update({at + gate: (fe, d), at + up: (fe, d), at + down: (d, fe)})
  if cfg.moe_score_bias:
    out[pre + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
  if cfg.num_shared_experts:
    width, at = fe * cfg.num_shared_experts, pre + "mlp.shared_experts."
    out.update({at + "gate_proj.weight": (width, d), at + "up_proj.weight": (width, d),
                at + "down_proj.weight": (d, width)})
  return out


def moe_params(cfg: ModelConfig, model_type: str, get: Callable[[str], Any],
               pre: str) -> MoEParams:
  """MoE layer `pre` ("model.layers.{i}.") of the checkpoint `get` reads."""
  if model_type == "gpt_oss":
    return _fused_params(cfg, get, pre)
  router, expert, (gate, up, down) = _names(model_type, pre)

  def mlp(at: str, names=(gate, up, down)) -> ExpertParams:
    return ExpertParams(w_gate=get(at + names[0]).T, w_up=get(at + names[1]).T,
                        w_down=get(at + names[2]).T)

  shared = (mlp(pre + "mlp.shared_experts.", ("gate_proj.weight", "up_proj.weight",
                                              "down_proj.weight"))
            if cfg.num_shared_experts else None)
  return MoEParams(
      router=get(router).T, experts=tuple(mlp(expert.format(e=e)) for e in range(cfg.num_experts)),
      score_bias=get(pre + "mlp.gate.e_score_correction_bias") if cfg.moe_score_bias else None,
      shared=shared)
