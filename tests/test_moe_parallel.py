"""Expert parallelism on kvjax.make_mesh(tp, ep) meshes (kvjax/moe/expert_parallel.py,
kvjax/parallel/sharding.py) equals one device: ep 2 x tp 2, ep 4 x tp 2, ep 8 x tp 1.

The checks run in one subprocess (tests/moe_sharded_checks.py: XLA_FLAGS must be set
before jax starts); each test here asserts on its report.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from kvjax.parallel import distributed

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_sharded_checks.py")
COMBOS = ["ep2_tp2", "ep4_tp2", "ep8_tp1"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("moe_ep") / "report.json"
  env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(_SCRIPT))}
  run = subprocess.run([sys.executable, _SCRIPT, str(out)], env=env, capture_output=True,
                       text=True, timeout=900)
  assert out.exists(), run.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("combo", COMBOS)
def test_expert_parallel_equals_one_device(report, combo):
  got = report[combo]
  ep, tp = (int(part[2:]) for part in combo.split("_"))
  assert got["mesh"] == {"data": 1, "expert": ep, "model": tp}
  assert got["tokens_equal"]
  assert got["logit_error_over_scale"] < 1e-5
  assert got["placement_ok"]  # experts e Ne/ep.., Fe slice m: on device (e, m) exactly


def test_tensor_parallel_alone_keeps_per_expert_leaves(report):
  got = report["tp2_only"]
  assert got["per_expert_leaves"] and got["logit_error_over_scale"] < 1e-5
  assert got["weight_bytes"] == [got["ledger_weight_bytes"]]


def test_engine_on_an_expert_parallel_mesh_equals_one_device(report):
  """Continuous batching (3 requests, 2 slots) with the prefix cache, at ep 4 x tp 2."""
  assert report["engine_ep4_tp2"]["tokens_equal"]
  assert report["engine_ep4_tp2"]["prefix_hit_tokens"] >= 8  # the third request's 2 pages


def test_generate_cli_ep_loads_an_hf_checkpoint_onto_the_mesh(report):
  """`kvjax generate --tp 2 --ep 2` on a Qwen3-MoE HF directory: one device's tokens."""
  assert report["cli_hf_ep2_tp2"] == {"exit_code": 0, "tokens_equal": True}


@pytest.mark.parametrize("combo", COMBOS)
def test_one_all_reduce_per_moe_layer_over_the_replica(report, combo):
  """Each MoE layer: one all-reduce over all ep x tp devices, no all-to-all, no gathered
  weights; the other all-reduces are the tensor-parallel ones (none at tp 1)."""
  got = report[combo]
  assert got["moe_all_reduces"] == report["moe_layers"] == 2
  assert got["all_to_alls"] == got["all_gathers"] == 0
  assert (got["other_all_reduces"] == 0) == combo.endswith("tp1")


@pytest.mark.parametrize("combo", COMBOS)
def test_weight_bytes_per_device_equal_the_ledger(report, combo):
  """kvjax.parallel.ledger_tp's per-device bytes equal the placed arrays' shards, on every device."""
  got = report[combo]
  assert got["weight_bytes"] == [got["ledger_weight_bytes"]]
  assert got["expert_bytes"] == [got["ledger_expert_bytes"]]


def test_restore_and_data_parallel_rows_on_an_expert_parallel_mesh(report):
  got = report["restore"]
  assert got["restored_as_placed"]
  assert got["replicas"] == [{"data": 1, "expert": 2, "model": 2}] * 2 and got["disjoint"]


def test_ep_flag_states_its_default():
  parser = argparse.ArgumentParser()
  distributed.add_parallel_flags(parser)
  text = " ".join(parser.format_help().split())
  assert "--ep EP expert-parallel degree for a mixture-of-experts model" in text
  assert "(default: 1, every device holds every expert)" in text


def test_bad_meshes_are_refused(report):
  assert report["ep3_error"] == "num_experts 8 of 'moe-ep' does not split over ep=3"
  assert "ep=2 splits routed experts, and 'tiny' has none" in report["dense_ep2_error"]
  assert report["ep16_error"].startswith("tp=2 x dp=1 x ep=8 needs 16 devices, only 8")
