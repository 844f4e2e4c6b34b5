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
(4) what bounds (1) on a CPU: every layer's switched experts at batch 1 with the
    same k experts every call ("hot": their weights stay in the last-level cache,
    as the dense twin's whole weights do) and with the experts rotating through all
    Ne ("cold": read from DRAM, as random routing mostly reads them), against the
    dense twin's MLPs; the same code, only where its bytes come from differs.
(5) the grouped path's ragged matmul records (kvjax/moe/grouped_matmul.py) at a
    prefill shape: each installed one timed and checked against "xla" (on a CPU,
    tokamax runs its own XLA implementation: the dry run of its GPU kernels).
Prints the issue's claim, the goal and ours; writes results/<name>.json.
"""
import functools
import importlib.util
import itertools

from absl import app, logging
from ml_collections import config_flags
import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from experiments import common
from kvjax.model.decoder import forward
from kvjax.model.params import init_params
from kvjax.model.decoder import swiglu
from kvjax.moe.grouped import grouped_experts, switched_experts
from kvjax.moe.grouped_matmul import GROUPED_MATMULS
from kvjax.moe.routing import route
from kvjax.parallel import ledger
from kvjax.runtime.xla_options import step_compiler_options


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
  grouped = np.asarray(timings.first_results["grouped"])
  # float32 sums in another order: the error grows with the outputs' scale (wide layers)
  np.testing.assert_allclose(timings.first_results["switched"], grouped, rtol=1e-4,
                             atol=1e-5 * max(1.0, float(np.abs(grouped).max())))
  return {"seconds": seconds, "grouped_over_switched": seconds["grouped"] / seconds["switched"]}


def last_level_cache_bytes() -> int:
  """The CPU's largest cache (sysfs; 0 where the OS does not say)."""
  sizes = []
  for index in range(8):
    try:
      with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as size:
        text = size.read().strip()
    except OSError:
      break
    sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM"
                 else int(text))
  return max(sizes, default=0)


def section_cache(c, built: dict) -> dict:
  moe_cfg, dense_cfg = built["moe"].config, built["dense"].config
  layers = [block.moe.experts for block in built["moe"].params.blocks]
  k, ne = c.num_experts_per_tok, c.num_experts
  weights = jnp.full((1, k), 1.0 / k)
  jit = functools.partial(jax.jit, compiler_options=dict(step_compiler_options("decode")) or None)

  @jit
  def experts(layers, x, chosen):  # chosen [L, 1, k]: each layer's experts this call
    for layer, ids in zip(layers, chosen):
      x = x + switched_experts(layer, x, weights, ids)
    return x

  @jit
  def dense(blocks, x):
    for block in blocks:
      x = x + swiglu(dense_cfg, block, x[None])[0]
    return x

  x = jax.random.normal(jax.random.PRNGKey(c.seed), (1, c.hidden_size))
  rotation = itertools.cycle([jnp.asarray(np.broadcast_to(
      (np.arange(k) + i * k) % ne, (c.num_layers, 1, k)), jnp.int32) for i in range(ne // k)])
  hot = jnp.asarray(np.broadcast_to(np.arange(k), (c.num_layers, 1, k)), jnp.int32)
  runs = {"dense": functools.partial(dense, built["dense"].params.blocks, x),
          "moe_hot": functools.partial(experts, layers, x, hot),
          "moe_cold": lambda: experts(layers, x, next(rotation))}
  seconds = common.interleaved(runs, c.repeats, inner=2 * ne, block=jax.block_until_ready
                               ).medians()
  expert_bytes = 4 * 3 * c.hidden_size * c.moe_intermediate_size  # one expert's float32
  return {"seconds": seconds, "hot_over_dense": seconds["moe_hot"] / seconds["dense"],
          "cold_over_dense": seconds["moe_cold"] / seconds["dense"],
          "last_level_cache_bytes": last_level_cache_bytes(),
          "read_per_step_bytes": expert_bytes * k * c.num_layers,
          "all_experts_bytes": expert_bytes * ne * c.num_layers,
          "dense_params_bytes": 4 * ledger.param_count(dense_cfg),
          "moe_params_bytes": 4 * ledger.param_count(moe_cfg)}


def section_grouped_matmuls(c, built: dict) -> dict:
  layer = built["moe"].params.blocks[0].moe
  x = jax.random.normal(jax.random.PRNGKey(c.seed), (c.grouped_tokens, c.hidden_size))
  weights, chosen = route(built["moe"].config, x @ layer.router)
  names = [name for name, record in GROUPED_MATMULS.items()
           if record.requires is None or importlib.util.find_spec(record.requires)]
  runs = {name: functools.partial(jax.jit(functools.partial(
      grouped_experts, matmul=GROUPED_MATMULS[name])), layer.experts, x, weights, chosen)
          for name in names}
  timings = common.interleaved(runs, c.repeats, inner=5, block=jax.block_until_ready)
  for name in names:
    np.testing.assert_allclose(timings.first_results[name], timings.first_results["xla"],
                               rtol=1e-5, atol=1e-5)
  return {"seconds": timings.medians(), "tokens": c.grouped_tokens,
          "platform": jax.default_backend()}


def cache_row(c, m: dict) -> dict:
  return {"claim": "#30", "what": "all layers' experts at batch 1 / dense twin's MLPs: the "
                                  "same k every call (hot), all Ne in turn (cold)",
          "seed": f"goal <= {c.goal_ratio}x",
          "ours": f"hot {m['hot_over_dense']:.2f}x, cold {m['cold_over_dense']:.2f}x (L3 "
                  f"{m['last_level_cache_bytes'] / 1e6:.1f} MB; params: dense "
                  f"{m['dense_params_bytes'] / 1e6:.1f} MB, MoE {m['moe_params_bytes'] / 1e6:.1f})"}


def plot(results: dict, path: str) -> None:
  """Left: batch-1 time per output token, MoE vs dense twin; right (CPU): all layers'
  experts, cache-hot and cold, vs the dense twin's MLPs."""
  panels = 2 if "cache" in results else 1
  with common.figure(path, 1, panels, figsize=(5 * panels, 3.5), squeeze=False) as (_, axes):
    tpot = results["decode"]["tpot_s"]
    axes[0][0].bar(list(tpot), [seconds * 1e3 for seconds in tpot.values()],
                   color=["tab:orange", "tab:blue"])
    axes[0][0].set(ylabel="ms per output token", title=f"batch-1 decode "
                   f"({results['decode']['ratio']:.2f}x)")
    if "cache" in results:
      seconds = results["cache"]["seconds"]
      axes[0][1].bar(list(seconds), [s * 1e6 for s in seconds.values()],
                     color=["tab:blue", "tab:green", "tab:red"])
      axes[0][1].set(ylabel="us per call", title="MLPs / experts of every layer, batch 1")


def run(c) -> dict:
  built = models(c)
  results = {"config": c.to_dict()}
  logging.info("decode")
  results["decode"] = section_decode(c, built)
  results["bytes"] = section_bytes(built)
  results["paths"] = section_paths(c, built)
  if jax.default_backend() == "cpu":  # a CPU's cache levels; a GPU run has no such row
    results["cache"] = section_cache(c, built)
  results["grouped_matmuls"] = section_grouped_matmuls(c, built)
  device = common.describe_device()  # its load average: as the timings end
  results.update(device=common.device_label(device), machine=device, jax=device["jax"])
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
       "ours": f"{p['grouped_over_switched']:.1f}x"},
      {"claim": "#30", "what": f"grouped path, {c.grouped_tokens} tokens, per ragged-matmul "
                               f"record on {results['grouped_matmuls']['platform']}",
       "seed": "tokamax = xla",
       "ours": ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds
                         in results["grouped_matmuls"]["seconds"].items())}]
  if "cache" in results:
    results["table"].insert(3, cache_row(c, results["cache"]))
  print(f"moe_bench on {results['device']}")
  common.print_claims(results["table"], "{claim:<5} {what:<90} {seed:<22} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(plot, results))
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
