"""Expert-parallel checks on 8 fake CPU devices, run in a subprocess by tests/test_moe_parallel.py.

`python tests/moe_sharded_checks.py OUT.json` sets XLA_FLAGS before jax starts
and writes {"ep<N>": measured values} for ep 2, 4, 8 (and ep 3's refusal).  Oracles: the same model
on one device (its greedy tokens, no-cache at every ep and paged at ep 8, and logits), the original per-expert weights
(which device holds which), the compiled HLO text (collectives).
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import kvjax  # noqa: E402
from kvjax.model import forward  # noqa: E402
from kvjax.moe.expert_parallel import shard_experts  # noqa: E402
from kvjax.params import init_params  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 9, 44], [3, 99, 12, 8, 61, 20]]  # one length: see greedy
NEW_TOKENS = 6


def model() -> kvjax.Model:
  """Random top-2 of 8 experts, a shared expert, layer 0 dense; std 0.2 for wide margins."""
  cfg = kvjax.get_preset("tiny").replace(
      name="moe-ep", vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
      num_layers=3, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
      moe_intermediate_size=32, first_k_dense_layers=1, norm_topk_prob=True)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def greedy(model: kvjax.Model, prompts, new_tokens: int) -> list:
  """Greedy continuations by no-cache forwards of one fixed [B, T + new] shape (one compile;
  the causal mask keeps the not-yet-written columns out of every read)."""
  step = jax.jit(forward, static_argnums=1)
  width = len(prompts[0])
  tokens = np.zeros((len(prompts), width + new_tokens), np.int32)
  tokens[:, :width] = prompts
  for column in range(width, width + new_tokens):
    logits = np.asarray(step(model.params, model.config, tokens))
    tokens[:, column] = logits[:, column - 1].argmax(-1)
  return tokens[:, width:].tolist()


def placement(one: kvjax.Model, sharded, ep: int) -> bool:
  """Device i's shard of every stacked expert leaf is experts [i Ne/ep, (i+1) Ne/ep) exactly."""
  for block, ref in zip(sharded.blocks, one.params.blocks):
    if ref.moe is None:
      continue
    for name in ("w_gate", "w_up", "w_down"):
      leaf = getattr(block.moe.experts, name)
      per_device = len(ref.moe.experts) // ep
      for shard in leaf.addressable_shards:
        i = list(leaf.sharding.mesh.devices.flat).index(shard.device)
        want = np.stack([getattr(e, name) for e in ref.moe.experts[i * per_device:
                                                                  (i + 1) * per_device]])
        if not np.array_equal(np.asarray(shard.data), want):
          return False
  return True


def main(out_path: str) -> None:
  assert jax.device_count() == 8, jax.devices()
  one = model()
  tokens = np.array([PROMPTS[0]], np.int32)
  ref_logits = np.asarray(kvjax.forward(one, tokens))
  ref_tokens = greedy(one, PROMPTS, NEW_TOKENS)
  ref_paged = kvjax.generate(one, PROMPTS, NEW_TOKENS, cache="paged", page_size=8).tokens
  report = {"moe_layers": sum(b.moe is not None for b in one.params.blocks)}
  for ep in (2, 4, 8):
    mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
    params = shard_experts(one.params, mesh)
    sharded = kvjax.Model(one.config, params)
    with jax.set_mesh(mesh):
      logits = np.asarray(kvjax.forward(sharded, tokens))
      generated = greedy(sharded, PROMPTS, NEW_TOKENS)
      if ep == 8:  # the paged cache and the decode loop too (one more set of compiles)
        report["ep8_paged_tokens_equal"] = kvjax.generate(
            sharded, PROMPTS, NEW_TOKENS, cache="paged", page_size=8).tokens == ref_paged
      hlo = jax.jit(forward, static_argnums=1).lower(params, one.config,
                                                     tokens).compile().as_text()
    report[f"ep{ep}"] = {
        "tokens_equal": generated == ref_tokens,
        "logit_error_over_scale": float(np.abs(logits - ref_logits).max() /
                                        np.abs(ref_logits).max()),
        "placement_ok": placement(one, params, ep),
        "all_reduces": len(re.findall(r"= \S+ all-reduce(?:-start)?\(", hlo)),
        "all_to_alls": len(re.findall(r"all-to-all", hlo))}
  try:
    shard_experts(one.params, Mesh(np.array(jax.devices()[:3]), ("expert",)))
    report["ep3_error"] = ""
  except ValueError as error:
    report["ep3_error"] = str(error)
  with open(out_path, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(sys.argv[1])
