"""Mixture of experts (issue 30): batch-1 decode of a small MoE vs a dense model with the
same active parameters on the CPU (goal: <= 1.3x), bytes per step from the HLO.

(1) decode: `kvjax.generate` of one prompt (paged cache, greedy) on a random MoE
    (top-k of Ne experts in every layer) and on its dense twin (MLP width
    k x Fe: the same active parameters, less the router); time per output token,
    median of interleaved rounds (common.interleaved), compile excluded.
(2) bytes: XLA's "bytes accessed" of one compiled batch-1 forward step of each,
    against the ledger's active and total parameter bytes (kvjax/parallel/ledger.py).
(3) one MoE layer's experts at batch 1: the switched path (reads the k chosen
    experts) vs the grouped path (sorted ragged_dot over all Ne; XLA:CPU runs
    it as a masked dense dot: the dense fallback, ~Ne / k x the work).
Prints the issue's claim, the goal and ours; writes results/<name>.json.
"""
import functools

from absl import app, logging
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from experiments import common
from kvjax.model.decoder import forward
from kvjax.model.params import init_params
from kvjax.moe.grouped import grouped_experts, switched_experts
from kvjax.moe.routing import route
from kvjax.parallel import ledger


def models(c) -> dict:
  """{"moe": ..., "dense": ...}: random models, std 0.2 (greedy margins >> rounding)."""
  moe = kvjax.ModelConfig(
      name="moe-bench", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
      intermediate_size=c.num_experts_per_tok * c.moe_intermediate_size,
      num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
      head_dim=c.head_dim, max_position_embeddings=1024, num_experts=c.num_experts,
      num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
      norm_topk_prob=True)
  dense = moe.replace(name="dense-bench", num_experts=0)
  key = jax.random.PRNGKey(c.seed)
  return {cfg.name.split("-")[0]: kvjax.Model(cfg, init_params(cfg, key, std=0.2))
          for cfg in (moe, dense)}


def step_bytes(model: kvjax.Model) -> float:
  """XLA's bytes accessed by one compiled batch-1, one-token forward step."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  cost = jax.jit(forward, static_argnums=1).lower(model.params, model.config,
                                                  tokens).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def section_decode(c, built: dict) -> dict:
  prompt = np.random.default_rng(c.seed).integers(3, c.vocab_size, c.prompt_len).tolist()
  runs = {name: functools.partial(kvjax.generate, model, [prompt], c.new_tokens,
                                  cache="paged", page_size=c.page_size)
          for name, model in built.items()}
  timings = common.interleaved(runs, c.repeats)
  tpot = {name: common.median([r.stats["tpot_s"] for r in results])
          for name, results in timings.results.items()}
  return {"tpot_s": tpot, "ratio": tpot["moe"] / tpot["dense"]}


def section_bytes(built: dict) -> dict:
  cfg = built["moe"].config
  out = {"step_bytes": {name: step_bytes(model) for name, model in built.items()},
         "active_param_bytes": 4 * ledger.param_count(cfg, active=True),
         "total_param_bytes": 4 * ledger.param_count(cfg)}
  out["moe_over_active"] = out["step_bytes"]["moe"] / out["active_param_bytes"]
  return out


def section_paths(c, built: dict) -> dict:
  layer = built["moe"].params.blocks[0].moe
  x = jax.random.normal(jax.random.PRNGKey(c.seed), (1, c.hidden_size))
  weights, chosen = route(built["moe"].config, x @ layer.router)
  runs = {name: functools.partial(jax.jit(path), layer.experts, x, weights, chosen)
          for name, path in (("switched", switched_experts), ("grouped", grouped_experts))}
  timings = common.interleaved(runs, c.repeats, inner=20, block=jax.block_until_ready)
  seconds = timings.medians()
  np.testing.assert_allclose(timings.first_results["switched"], timings.first_results["grouped"],
                             rtol=1e-4, atol=1e-5)
  return {"seconds": seconds, "grouped_over_switched": seconds["grouped"] / seconds["switched"]}


def run(c) -> dict:
  device = common.describe_device()
  built = models(c)
  results = {"device": common.device_label(device), "jax": device["jax"], "config": c.to_dict()}
  logging.info("decode")
  results["decode"] = section_decode(c, built)
  results["bytes"] = section_bytes(built)
  results["paths"] = section_paths(c, built)
  d, b, p = results["decode"], results["bytes"], results["paths"]
  results["table"] = [
      {"claim": "#30", "what": f"batch-1 decode, MoE top-{c.num_experts_per_tok}/{c.num_experts} "
                               "vs dense twin (same active params), tpot ratio",
       "seed": f"goal <= {c.goal_ratio}x",
       "ours": f"{d['ratio']:.2f}x ({d['tpot_s']['moe'] * 1e3:.2f} vs "
               f"{d['tpot_s']['dense'] * 1e3:.2f} ms)"},
      {"claim": "#30", "what": "bytes per batch-1 step from the HLO vs active params",
       "seed": "~ active, not total",
       "ours": f"{b['step_bytes']['moe'] / 1e6:.2f} MB = {b['moe_over_active']:.2f}x active "
               f"({b['active_param_bytes'] / 1e6:.2f} MB; total {b['total_param_bytes'] / 1e6:.2f}"
               f" MB; dense twin {b['step_bytes']['dense'] / 1e6:.2f} MB)"},
      {"claim": "#30", "what": "one layer's experts at batch 1: grouped (dense fallback on "
                               "XLA:CPU) / switched",
       "seed": f"~{c.num_experts // c.num_experts_per_tok}x (Ne / k)",
       "ours": f"{p['grouped_over_switched']:.1f}x"}]
  print(f"moe_bench on {results['device']}")
  common.print_claims(results["table"], "{claim:<5} {what:<90} {seed:<22} {ours}")
  common.write_results(c.out_dir, c.name, results)
  return results


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: tests import launchers side by side, and absl allows
  # one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/moe_bench.py", "experiment config", lock_config=True)
  app.run(main)
