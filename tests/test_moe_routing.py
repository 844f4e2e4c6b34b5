"""MoE routing vs HF's router modules (gpt-oss's with its bias), both expert paths (plain
and clamped SwiGLU, with biases) vs float64 numpy, the batch-1 step's bytes from the
compiled HLO (only the chosen experts are read)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import kvjax
from kvjax.model.decoder import forward
from kvjax.model.params import init_params
from kvjax.moe.activation import ExpertGLU
from kvjax.moe.grouped import grouped_experts, switched_experts
from kvjax.moe.params import init_moe
from kvjax.moe.routing import route
from kvjax.parallel import ledger

D, NE = 16, 8


def _dense_weights(weights, experts, num_experts):
  """[A, Ke] weights and ids -> [A, Ne] weight per expert (0 if not chosen)."""
  out = np.zeros((weights.shape[0], num_experts))
  np.put_along_axis(out, np.asarray(experts), np.asarray(weights), axis=-1)
  return out


ROUTERS = {
    "mixtral": (transformers.MixtralConfig(hidden_size=D, num_local_experts=NE,
                                           num_experts_per_tok=2),
                transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
                dict(num_experts=NE, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_moe": (transformers.Qwen3MoeConfig(hidden_size=D, num_experts=NE, num_experts_per_tok=3,
                                              norm_topk_prob=False),
                  transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter,
                  dict(num_experts=NE, num_experts_per_tok=3)),
    "deepseek_v3": (transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=NE,
                                                  num_experts_per_tok=3, n_group=4, topk_group=2,
                                                  norm_topk_prob=True, routed_scaling_factor=2.5),
                    transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter,
                    dict(num_experts=NE, num_experts_per_tok=3, moe_scoring="sigmoid",
                         moe_score_bias=True, moe_num_groups=4, moe_topk_groups=2,
                         norm_topk_prob=True, routed_scaling_factor=2.5)),
    "gpt_oss": (transformers.GptOssConfig(hidden_size=D, num_local_experts=NE,
                                          num_experts_per_tok=3),
                transformers.models.gpt_oss.modeling_gpt_oss.GptOssTopKRouter,
                dict(num_experts=NE, num_experts_per_tok=3, moe_softmax_after_topk=True)),
}


def _cfg(**moe):
  return kvjax.get_preset("tiny").replace(**{"hidden_size": D, "moe_intermediate_size": 8, **moe})


@pytest.mark.parametrize("family", sorted(ROUTERS))
@pytest.mark.parametrize("tied", [False, True])
def test_route_matches_hf_router(family, tied):
  hf_config, router_cls, moe = ROUTERS[family]
  torch.manual_seed(0)
  router = router_cls(hf_config)
  with torch.no_grad():
    router.weight.normal_(0, 1)
    if tied:  # experts 1, 4 and 6 score alike for every token
      router.weight[4] = router.weight[1]
      router.weight[6] = router.weight[1]
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
      bias.copy_(0.2 * torch.randn(NE))
    logits_bias = getattr(router, "bias", None)  # gpt-oss's, added in kvjax/moe/block.py
    if logits_bias is not None:
      logits_bias.copy_(0.2 * torch.randn(NE))
  hidden = torch.randn(64, D)
  with torch.no_grad():
    _, hf_weights, hf_experts = router(hidden)
  logits = hidden.numpy() @ router.weight.detach().numpy().T
  if logits_bias is not None:
    logits = logits + logits_bias.detach().numpy()
  weights, experts = route(_cfg(**moe), jnp.asarray(logits),
                           None if bias is None else jnp.asarray(bias.numpy()))
  np.testing.assert_allclose(_dense_weights(weights, experts, NE),
                             _dense_weights(hf_weights.numpy(), hf_experts.numpy(), NE),
                             atol=1e-6)


def test_group_limit_excludes_experts_outside_the_best_groups():
  cfg = _cfg(**ROUTERS["deepseek_v3"][2])
  logits = np.full((1, NE), -4.0, np.float32)
  logits[0, [0, 2, 4]] = [3.0, 2.9, 2.8]  # groups 0, 1, 2 each hold one strong expert
  logits[0, [1, 3]] = [2.9, 2.8]  # groups 0 and 1 hold a second: they win
  _, experts = route(cfg, jnp.asarray(logits))
  assert sorted(np.asarray(experts)[0].tolist()) == [0, 1, 2]  # 4 (group 2) excluded


def _numpy_experts(moe, x, weights, experts, limit=None, alpha=1.702):
  """float64 brute force: sum_k w_k expert_{e_k}(x) per token, SwiGLU or (a `limit`)
  gpt-oss's clamped SwiGLU, with the experts' biases where they have them."""
  out = np.zeros(x.shape, np.float64)
  f64 = lambda b: 0.0 if b is None else np.float64(b)
  for a in range(x.shape[0]):
    for w, e in zip(np.asarray(weights[a], np.float64), np.asarray(experts[a])):
      p = moe.experts[int(e)]
      g = x[a] @ np.float64(p.w_gate) + f64(p.b_gate)
      u = x[a] @ np.float64(p.w_up) + f64(p.b_up)
      if limit is None:
        h = g / (1 + np.exp(-g)) * u
      else:
        g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
        h = (u + 1) * g / (1 + np.exp(-alpha * g))
      out[a] += w * (h @ np.float64(p.w_down) + f64(p.b_down))
  return out


@pytest.mark.parametrize("path", [switched_experts, grouped_experts])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_expert_paths_match_float64(path, activation):
  clamped = activation == "clamped_swiglu"
  cfg = _cfg(num_experts=NE, num_experts_per_tok=2, expert_activation=activation,
             swiglu_limit=1.0, moe_bias=clamped)
  moe = init_moe(cfg, jax.random.PRNGKey(1), jnp.float32, std=0.5)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, D)).astype(np.float32)
  experts = np.array([[3, 1], [1, 3], [7, 7 - 1], [0, 2], [3, 5]], np.int32)
  weights = rng.uniform(size=(5, 2)).astype(np.float32)
  ours = path(moe.experts, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts),
              ExpertGLU.of(cfg))
  want = _numpy_experts(moe, np.float64(x), weights, experts, 1.0 if clamped else None)
  np.testing.assert_allclose(np.asarray(ours), want, atol=1e-5)


def _step_bytes(cfg, params, rows: int) -> float:
  tokens = jnp.zeros((rows, 1), jnp.int32)
  cost = jax.jit(forward, static_argnums=1).lower(params, cfg, tokens).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def test_batch_one_step_reads_active_params_not_total():
  cfg = kvjax.get_preset("tiny").replace(name="moe", vocab_size=256, num_experts=16,
                                         num_experts_per_tok=2, moe_intermediate_size=256)
  dense = cfg.replace(name="dense", num_experts=0, intermediate_size=2 * 256)
  active, total = (4 * ledger.param_count(cfg, active) for active in (True, False))
  routers = cfg.num_layers * cfg.hidden_size * cfg.num_experts
  assert 4 * (ledger.param_count(dense) + routers) == active  # the dense twin's, + routers
  moe_bytes = _step_bytes(cfg, init_params(cfg, jax.random.PRNGKey(0)), 1)
  dense_bytes = _step_bytes(dense, init_params(dense, jax.random.PRNGKey(0)), 1)
  # Measured ~0.98x active (the embedding table is gathered, not read); total is 5.9x active.
  assert 0.8 * active < moe_bytes < 1.15 * active < total / 4
  assert moe_bytes < 1.1 * dense_bytes


@pytest.mark.parametrize("field, value, match", [
    ("moe_num_groups", 3, "groups"), ("moe_topk_groups", 5, "groups"),
    ("num_experts_per_tok", 9, "moe_topk_groups|exceeds"), ("moe_scoring", "relu", "moe_scoring"),
    ("moe_intermediate_size", 0, "moe_intermediate_size")])
def test_bad_moe_config_names_the_field(field, value, match):
  good = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8, moe_num_groups=4,
              moe_topk_groups=2)
  with pytest.raises(ValueError, match=match):
    _cfg(**{**good, field: value})


def test_sparse_step_and_mlp_only_layers_follow_hf():
  hf = transformers.Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3],
                                   num_experts=4, num_experts_per_tok=2, hidden_size=16, intermediate_size=16,
                                   moe_intermediate_size=8, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8, vocab_size=32)
  theirs = [hasattr(layer.mlp, "experts") for layer in
            transformers.Qwen3MoeForCausalLM(hf).model.layers]
  from kvjax.weights.hf_config import config_from_hf
  cfg = config_from_hf(hf.to_dict())
  assert [cfg.is_moe_layer(i) for i in range(6)] == theirs == [False, True, False, False,
                                                                False, True]
