"""Expert-parallel checks on 8 fake CPU devices, run in a subprocess by tests/test_moe_parallel.py.

`python tests/moe_sharded_checks.py OUT.json` sets XLA_FLAGS before jax starts and
writes {"ep<E>_tp<T>": measured values} for the (ep, tp) meshes of kvjax.make_mesh
in COMBOS, plus the Engine run, `kvjax generate --ep` on an HF checkpoint and the
refusals.  Oracles: the same
model on one device (its greedy tokens and logits by no-cache forwards), the
original per-expert weights (which device holds which slice), the compiled HLO
text (collectives), and the placed arrays' own bytes per device.
"""
from __future__ import annotations

import os
import sys

# LLVM at -O0: these tiny models' checks are XLA-compile bound (many distinct
# sharded programs) and compare programs built alike; -O0 halves each compile, the HLO (its
# sharding and collectives, what is checked) is the same.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax.cli import main as cli
from kvjax.model.decoder import forward  # noqa: E402
from kvjax.model.params import init_params  # noqa: E402
from kvjax.parallel import ledger_tp
from kvjax.parallel import sharding  # noqa: E402
from kvjax.weights.checkpoint import save  # noqa: E402

# One length (see greedy); all share 8 tokens, two pages of the prefix cache, which the
# third (admitted once a slot frees: max_num_seqs 2) finds cached.
PROMPTS = [[5, 17, 33, 2, 9, 44, 71, 8, 1, 3], [5, 17, 33, 2, 9, 44, 71, 8, 60, 4],
           [5, 17, 33, 2, 9, 44, 71, 8, 14, 2]]
NEW_TOKENS = 6
COMBOS = ((2, 2), (4, 2), (8, 1))  # (ep, tp)


def model() -> kvjax.Model:
  """Random top-2 of 8 experts with biases, a shared expert, layer 0 dense; std 0.2 for
  wide margins."""
  cfg = kvjax.get_preset("tiny").replace(
      name="moe-ep", vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
      num_layers=3, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
      moe_intermediate_size=32, first_k_dense_layers=1, norm_topk_prob=True, moe_bias=True)
  return kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))


def greedy(step, prompts, new_tokens: int) -> tuple[list, np.ndarray]:
  """Greedy continuations by no-cache forwards `step(tokens)` of one fixed [B, T + new]
  shape (one compile; the causal mask keeps the not-yet-written columns out of every
  read) -> (tokens, the last forward's logits)."""
  width = len(prompts[0])
  tokens = np.zeros((len(prompts), width + new_tokens), np.int32)
  tokens[:, :width] = prompts
  for column in range(width, width + new_tokens):
    logits = np.asarray(step(tokens))
    tokens[:, column] = logits[:, column - 1].argmax(-1)
  return tokens[:, width:].tolist(), logits


def placement(one: kvjax.Model, sharded, tp: int, ep: int) -> bool:
  """The shard on device (e, m) of the (expert, model) grid of every stacked expert leaf is
  experts [e Ne/ep, (e+1) Ne/ep) exactly, their Fe slice m of tp (b_down whole)."""
  fe_axis = {"w_gate": 2, "w_up": 2, "w_down": 1, "b_gate": 1, "b_up": 1, "b_down": None}
  for block, ref in zip(sharded.blocks, one.params.blocks):
    if ref.moe is None:
      continue
    per_device = len(ref.moe.experts) // ep
    for name, axis in fe_axis.items():
      leaf = getattr(block.moe.experts, name)
      for shard in leaf.addressable_shards:
        _, e, m = np.argwhere(leaf.sharding.mesh.devices == shard.device)[0]
        want = np.stack([getattr(x, name) for x in ref.moe.experts[e * per_device:
                                                                  (e + 1) * per_device]])
        if axis is not None:
          width = want.shape[axis] // tp
          want = np.take(want, np.arange(m * width, (m + 1) * width), axis=axis)
        if not np.array_equal(np.asarray(shard.data), want):
          return False
  return True


def collectives(hlo: str, devices: int) -> dict:
  """All-reduces of the compiled program: the MoE combines (the psum over expert x model:
  one group of every device) and the rest; all-to-alls and all-gathers."""
  reduces = [line for line in hlo.splitlines() if re.search(r"= \S+ all-reduce(-start)?\(", line)]
  whole = "replica_groups={{" + ",".join(map(str, range(devices))) + "}}"
  return {"moe_all_reduces": sum("shard_map/psum" in line and whole in line for line in reduces),
          "other_all_reduces": sum("shard_map/psum" not in line for line in reduces),
          "all_to_alls": len(re.findall(r"all-to-all", hlo)),
          "all_gathers": len(re.findall(r"all-gather(-start)?\(", hlo))}


def device_bytes(tree) -> dict:
  """Bytes each device holds of a pytree's arrays, summed over its addressable shards."""
  per_device = {}
  for leaf in jax.tree_util.tree_leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[str(shard.device)] = per_device.get(str(shard.device), 0) + shard.data.nbytes
  return per_device


def check_combo(one: kvjax.Model, ep: int, tp: int, ref_tokens, ref_logits) -> dict:
  mesh = kvjax.make_mesh(tp=tp, ep=ep)
  sharded = kvjax.Model(one.config, sharding.shard_params(one.params, mesh))
  width = len(PROMPTS[0]) + NEW_TOKENS
  compiled = jax.jit(forward, static_argnums=1).lower(
      sharded.params, one.config, np.zeros((len(PROMPTS), width), np.int32)).compile()
  tokens, logits = greedy(lambda t: compiled(sharded.params, t), PROMPTS, NEW_TOKENS)
  experts = [b.moe.experts for b in sharded.params.blocks if b.moe is not None]
  return {"mesh": dict(sharded.mesh.shape), "tokens_equal": tokens == ref_tokens,
          "logit_error_over_scale": float(np.abs(logits - ref_logits).max() /
                                          np.abs(ref_logits).max()),
          "placement_ok": placement(one, sharded.params, tp, ep),
          **collectives(compiled.as_text(), ep * tp),
          "weight_bytes": sorted(set(device_bytes(sharded.params).values())),
          "expert_bytes": sorted(set(device_bytes(experts).values())),
          "ledger_weight_bytes": ledger_tp.weight_bytes_per_device(one.config, tp, "fp32", ep),
          "ledger_expert_bytes": ledger_tp.expert_bytes_per_device(one.config, tp, "fp32", ep)}


def check_tp_only(one: kvjax.Model, ref_logits) -> dict:
  """tp 2 without an "expert" axis: experts stay per-expert leaves, each one's Fe split over
  "model" (GSPMD); logits equal one device, bytes per device the ledger's at ep 1."""
  sharded = kvjax.Model(one.config, sharding.shard_params(one.params, kvjax.make_mesh(tp=2)))
  logits = np.asarray(kvjax.forward(sharded, np.array(PROMPTS, np.int32)))
  return {"per_expert_leaves": all(isinstance(b.moe.experts, tuple)
                                   for b in sharded.params.blocks if b.moe),
          "logit_error_over_scale": float(np.abs(logits - ref_logits[:, :len(PROMPTS[0])]).max()
                                          / np.abs(ref_logits).max()),
          "weight_bytes": sorted(set(device_bytes(sharded.params).values())),
          "ledger_weight_bytes": ledger_tp.weight_bytes_per_device(one.config, 2, "fp32")}


def check_engine(one: kvjax.Model, ep: int, tp: int, ref_tokens) -> dict:
  """The continuous-batching Engine (2 slots for 3 requests, prefix cache on) on the mesh."""
  sharded = kvjax.Model(one.config, sharding.shard_params(one.params,
                                                          kvjax.make_mesh(tp=tp, ep=ep)))
  engine = kvjax.Engine(sharded, max_num_seqs=2, max_model_len=32, page_size=4,
                        prefix_cache=True)
  tokens = engine.generate(PROMPTS, NEW_TOKENS).tokens
  return {"tokens_equal": tokens == ref_tokens,
          "prefix_hit_tokens": engine.stats().prefix_hit_tokens}


def check_cli_hf(one_step) -> dict:
  """`kvjax generate --checkpoint <HF Qwen3-MoE dir> --tp 2 --ep 2`: the loader places each
  device's own experts' slices (kvjax/parallel/sharding.py place_host_params); tokens equal one
  device's greedy ones."""
  from tests.moe_models import save_tiny

  with tempfile.TemporaryDirectory() as directory:
    save_tiny("qwen3_moe", directory)
    one = kvjax.load_checkpoint(directory)
    want, _ = greedy(lambda t: one_step(one.params, one.config, t), PROMPTS[:1], NEW_TOKENS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      code = cli.main(["generate", "--checkpoint", directory, "--tp", "2", "--ep", "2",
                       "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens",
                       str(NEW_TOKENS), "--temperature", "0", "--no-warmup", "--json"])
  return {"exit_code": code, "tokens_equal": json.loads(out.getvalue())["tokens"] == want[0]}


def check_restore_and_replicas(one: kvjax.Model) -> dict:
  """A kvjax-native checkpoint restored onto an ep 2 x tp 2 mesh holds what shard_params
  places (values and shardings); dp 2 x ep 2 x tp 2 gives two disjoint replica meshes."""
  mesh = kvjax.make_mesh(tp=2, ep=2)
  want = sharding.shard_params(one.params, mesh)
  with tempfile.TemporaryDirectory() as directory:
    save(directory, one.config, one.params)
    got = kvjax.load_checkpoint(directory, mesh=mesh).params
  leaves = jax.tree_util.tree_leaves
  same = jax.tree.structure(got) == jax.tree.structure(want) and all(
      a.sharding == b.sharding and np.array_equal(a, b) for a, b in zip(leaves(got),
                                                                         leaves(want)))
  rows = sharding.submeshes(kvjax.make_mesh(tp=2, ep=2, dp=2))
  return {"restored_as_placed": bool(same), "replicas": [dict(row.shape) for row in rows],
          "disjoint": not set(rows[0].devices.flat) & set(rows[1].devices.flat)}


def refusal(fn) -> str:
  try:
    fn()
  except ValueError as error:
    return str(error)
  return ""


def main(out_path: str) -> None:
  assert jax.device_count() == 8, jax.devices()
  one = model()
  one_step = jax.jit(forward, static_argnums=1)
  ref_tokens, ref_logits = greedy(lambda t: one_step(one.params, one.config, t), PROMPTS,
                                  NEW_TOKENS)
  report = {"moe_layers": sum(b.moe is not None for b in one.params.blocks)}
  for ep, tp in COMBOS:
    report[f"ep{ep}_tp{tp}"] = check_combo(one, ep, tp, ref_tokens, ref_logits)
  report["tp2_only"] = check_tp_only(one, ref_logits)
  report["engine_ep4_tp2"] = check_engine(one, 4, 2, ref_tokens)
  report["cli_hf_ep2_tp2"] = check_cli_hf(one_step)
  report["restore"] = check_restore_and_replicas(one)
  report["ep3_error"] = refusal(lambda: sharding.check_mesh(one.config,
                                                            kvjax.make_mesh(ep=3)))
  report["dense_ep2_error"] = refusal(lambda: kvjax.load_checkpoint(
      "tiny", mesh=kvjax.make_mesh(ep=2)))
  report["ep16_error"] = refusal(lambda: kvjax.make_mesh(tp=2, ep=8))
  with open(out_path, "w") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
