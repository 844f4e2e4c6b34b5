"""Expert parallelism (kvjax/moe/expert_parallel.py) at ep 2 / 4 / 8 equals one device.

The checks run in one subprocess (tests/moe_sharded_checks.py: XLA_FLAGS must be set
before jax starts); each test here asserts on its report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_sharded_checks.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("moe_ep") / "report.json"
  env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(_SCRIPT))}
  run = subprocess.run([sys.executable, _SCRIPT, str(out)], env=env, capture_output=True,
                       text=True, timeout=900)
  assert out.exists(), run.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_equals_one_device(report, ep):
  got = report[f"ep{ep}"]
  assert got["tokens_equal"]
  assert got["logit_error_over_scale"] < 1e-5
  assert got["placement_ok"]


def test_expert_parallel_paged_generate_equals_one_device(report):
  assert report["ep8_paged_tokens_equal"]


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_one_all_reduce_per_moe_layer_and_no_all_to_all(report, ep):
  assert report[f"ep{ep}"]["all_reduces"] == report["moe_layers"] == 2
  assert report[f"ep{ep}"]["all_to_alls"] == 0


def test_experts_that_do_not_split_are_refused(report):
  assert "8 experts do not split over ep=3" in report["ep3_error"]
