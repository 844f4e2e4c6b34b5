"""Tensor parallelism on 8 fake CPU devices (kvjax/parallel/sharding.py, backends.on_mesh).

The checks run in one subprocess (tests/sharded_checks.py: XLA_FLAGS must be set
before jax starts, and the rest of the suite runs on one device); each test
here asserts on one check's report.  Single-process parts (mesh and spec
errors) run here on the one CPU device.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import pytest

import kvjax
from kvjax.model.params import init_params
from kvjax.parallel import ledger_tp
from kvjax.parallel import sharding
from tests.run_once import once_per_run
from kvjax.weights.checkpoint import save

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_checks.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  def run_checks():
    out = tmp_path_factory.mktemp("sharded") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, _SCRIPT, str(out)], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert out.exists(), run.stderr[-4000:]
    return json.loads(out.read_text())

  return once_per_run(tmp_path_factory, "sharded_checks", run_checks)


def _ok(report, name):
  entry = report[name]
  assert entry["ok"], entry.get("error")
  return entry


def test_llama_gqa_tokens_and_logits_at_tp_2_and_8(report):
  entry = _ok(report, "check_llama_gqa")
  for tp, kv_heads in ((2, 2), (8, 8)):  # GQA 8/2: split at tp 2, replicated 4x at tp 8
    got = entry[f"tp{tp}"]
    assert got["kv_heads"] == kv_heads
    assert got["tolerance"] < 1e-4  # ~40 ulp of the largest logit (sharded_checks)
    assert max(got["forward_diff"], got["prefill_diff"]) < got["tolerance"]
    assert got["leaves"] == 2 + 1 + 2 * 9  # embed, lm_head, final norm; 9 leaves a block


def test_engine_on_a_sharded_model_reference_and_pallas(report):
  entry = _ok(report, "check_llama_engine")
  for backend in ("reference", "pallas_interpret"):
    assert entry[backend]["k_pages_shard"][1] == 1  # [L, K'/tp, P, Z, H]: one head a device


def test_a_variant_scores_global_heads_on_a_mesh(report):
  _ok(report, "check_variant")  # ALiBi on tp 4: reference and Pallas, single-device greedy


def test_qwen3_mistral_window_and_mla(report):
  entry = _ok(report, "check_families")
  assert entry["mistral"]["kv_heads"] == 2  # MQA replicated to tp
  assert entry["deepseek_v2"]["kv_heads"] == 4  # MLA: no kv-head replication
  assert all(entry[name]["prefill_diff"] < 1e-5 for name in ("qwen3", "mistral", "deepseek_v2"))


def test_int8_and_int4_pages_and_scales_split_by_kv_head(report):
  entry = _ok(report, "check_int8_kv")
  assert entry["scale_shard"][1] == 1 and entry["int4_scale_shard"][1] == 1


def test_mtp_speculation_on_a_sharded_model(report):
  _ok(report, "check_mtp")


def test_router_over_submeshes(report):
  entry = _ok(report, "check_router_submeshes")
  assert entry["devices"] == [[0, 1], [2, 3]] and sorted(set(entry["replicas"])) == [0, 1]


def test_two_all_reduces_per_dense_block(report):
  assert _ok(report, "check_collectives")["per_layer"] == 2


def test_step_runs_under_transfer_guard(report):
  _ok(report, "check_transfer_guard")


def test_per_device_bytes_equal_kvjax_memory(report):
  entry = _ok(report, "check_memory_ledger")
  assert entry["tp4_fp32"]["kv_replication"] == 2  # tiny: K=2 stored as 4 heads at tp 4
  # fp32: 1 kv head a device x K+V x 2 layers x head_dim 32 x 4 B; int8 adds 4 B scales.
  assert entry["tp4_fp32"]["kv_per_token"] == 2 * 2 * 32 * 4
  assert entry["tp4_int8"]["kv_per_token"] == 2 * 2 * (32 + 4)


def test_tp_plan_by_hand():
  """Llama-3-70B (80 layers, 8 kv heads of 128, bf16) at tp 8: one kv head a device."""
  cfg = kvjax.get_preset("llama3-70b")
  plan = ledger_tp.tp_plan(cfg, 8192, 8, batch=64, gpu_gib=141)
  assert plan.kv_bytes_per_token_per_device == 80 * 2 * 128 * 2
  assert plan.kv_replication == 1 and plan.kv_replication_bytes_per_token == 0
  assert plan.fits and plan.smallest_tp == 4
  tiny = ledger_tp.tp_plan(kvjax.get_preset("tiny"), 64, 4)  # K=2 -> 4 stored heads
  assert (tiny.kv_replication, tiny.kv_replication_bytes_per_token) == (2, 2 * 2 * 2 * 32 * 2)
  with pytest.raises(ValueError, match="'tiny' does not split over tp=8"):
    ledger_tp.tp_plan(kvjax.get_preset("tiny"), 64, 8)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_split_one_model_like_one_process(tmp_path):
  """`kvjax generate --tp 8` over 2 CPU processes x 4 devices (gloo all-reduces between
  them, the orbax checkpoint restored shard by shard) gives one process's tokens."""
  cfg = kvjax.get_preset("tiny").replace(name="tiny-8heads", num_heads=8, head_dim=16)
  save(str(tmp_path / "ckpt"), cfg, init_params(cfg, jax.random.PRNGKey(0), std=0.2))
  prompt = [1, 5, 9, 33, 2]
  want = kvjax.generate(kvjax.load_checkpoint(str(tmp_path / "ckpt")), [prompt], 8).tokens[0]
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "kvjax", "generate", "--checkpoint", str(tmp_path / "ckpt"),
       "--tp", "8", "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
       "--process-id", str(i), "--prompt-ids", ",".join(map(str, prompt)),
       "--max-new-tokens", "8", "--json", "--no-warmup"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
  try:
    outputs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == want


def test_make_mesh_axes_and_errors():
  mesh = kvjax.make_mesh()
  assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (1, 1)
  with pytest.raises(ValueError, match="tp=2 x dp=1 needs 2 devices"):
    kvjax.make_mesh(tp=2, devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="tp must be an int >= 1, got 0"):
    kvjax.make_mesh(tp=0)


def test_specs_and_replication_arithmetic():
  assert sharding.replicated_kv_heads(2, 8) == 8 and sharding.replicated_kv_heads(8, 4) == 8
  assert sharding.replicated_kv_heads(3, 2) == 6
  assert sharding.param_spec("wq", (64, 8, 16), 4) == jax.sharding.PartitionSpec(None, "model")
  assert sharding.param_spec("embed", (259, 64), 2) == jax.sharding.PartitionSpec()  # odd vocab
  with pytest.raises(ValueError, match=r"w_up \(64, 30\): axis 1 \(ffn\) does not split over "
                                       "tp=4"):
    sharding.param_spec("w_up", (64, 30), 4)
