"""Mechanism arithmetic (C2, C3, C7, C11) against brute force and the seeds' numbers;
the report over the committed results."""
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import mechanism_counts as counts
from experiments import report
from kvjax.model.params import init_params
from kvjax.model.presets import get_preset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- C2 -------------------------------------------------------------------------


def _enumerated_scores(n):
  """Independent oracle: visit every (step, query, key) triple."""
  full = causal = cached = 0
  for t in range(1, n + 1):
    for i, j in itertools.product(range(t), range(t)):
      full += 1
      causal += j <= i
    cached += sum(1 for _ in range(t))
  return dict(no_cache=full, no_cache_causal=causal, cache=cached)


@pytest.mark.parametrize("n", [1, 2, 7, 20])
def test_score_entries_match_enumeration(n):
  assert counts.score_entries(n) == _enumerated_scores(n)


@pytest.mark.parametrize("n", [1, 14, 100, 512])
def test_score_entries_match_closed_forms(n):
  e = counts.score_entries(n)
  assert e["no_cache"] == n * (n + 1) * (2 * n + 1) // 6  # sum t^2
  assert e["cache"] == n * (n + 1) // 2  # sum t
  assert e["no_cache"] / e["cache"] == pytest.approx((2 * n + 1) / 3)


def test_seed_attention_ratios():
  e = counts.score_entries(512)
  assert round(e["no_cache"] / e["cache"], 1) == 341.7  # C2: 341.7x at n = 512
  pairs = counts.kv_pairs(14)
  assert pairs == dict(no_cache=105, cache=14)
  assert pairs["no_cache"] / pairs["cache"] == 7.5  # C2: pairs view, 7.5x at n = 14
  ratio = counts.kv_pairs(1000)["no_cache"] / counts.kv_pairs(100)["no_cache"]
  assert ratio == pytest.approx(100, rel=0.01)  # seed 000: 100x, not 10x


def test_counts_reject_empty_generation():
  with pytest.raises(ValueError, match="n must be >= 1, got 0"):
    counts.score_entries(0)


# -- C3 -------------------------------------------------------------------------


def test_matmul_params_equal_the_parameter_tree():
  cfg = get_preset("tiny")
  shapes = jax.eval_shape(lambda key: init_params(cfg, key, jnp.float32), jax.random.PRNGKey(0))
  size = lambda x: int(np.prod(x.shape))
  blocks = sum(size(x) for b in shapes.blocks
               for x in (b.attn.wq, b.attn.wk, b.attn.wv, b.attn.wo, b.w_gate, b.w_up, b.w_down))
  head = size(shapes.lm_head) if shapes.lm_head is not None else size(shapes.embed)
  assert counts.matmul_params(cfg) == blocks + head


@pytest.mark.parametrize("n", [1, 128, 8192, 131072])
def test_attention_decode_does_one_flop_per_kv_byte(n):
  # Seed C3: 4*n*d FLOPs over 2*n*d fp16 values, for MHA; GQA multiplies by the group.
  assert counts.step_cost(get_preset("llama2-7b"), n, 1, 2)[
      "attention_flops_per_kv_byte"] == 1.0
  assert counts.step_cost(get_preset("llama3-8b"), n, 1, 2)[
      "attention_flops_per_kv_byte"] == 4.0


def test_prefill_intensity_dwarfs_decode():
  cfg = get_preset("llama3-8b")
  decode = counts.step_cost(cfg, 4096, 1, 2)
  prefill = counts.step_cost(cfg, 0, 4096, 2)
  assert decode["intensity"] < 2 < 1000 < prefill["intensity"]
  # Prefill: query i sees i + 1 keys, so the keys sum to T(T+1)/2.
  keys = 4096 * 4097 // 2
  assert prefill["attention_flops"] == cfg.num_layers * cfg.num_heads * keys * 4 * cfg.head_dim


def test_step_cost_rejects_mla():
  with pytest.raises(ValueError, match="deepseek-v2"):
    counts.step_cost(get_preset("deepseek-v2"), 16, 1, 2)


# -- C7 -------------------------------------------------------------------------


def test_workload_fits_max_model_len():
  workload = counts.lognormal_workload(200, 300, 200, 1.0, 1024, seed=3)
  assert workload == counts.lognormal_workload(200, 300, 200, 1.0, 1024, seed=3)
  assert all(p >= 1 and o >= 1 and p + o <= 1024 for p, o in workload)


@pytest.fixture(scope="module")
def pools():
  workload = counts.lognormal_workload(40, 200, 100, 0.8, 512, seed=0)
  kwargs = dict(pool_tokens=4096, max_model_len=512, max_num_batched_tokens=512,
                check_every=1)  # the scheduler's invariants after every step
  return workload, {name: counts.simulate_pool(workload, page_size=g, **kwargs)
                    for name, g in (("paged", 16), ("contiguous", 512))}


def test_pool_simulation_invariants(pools):
  workload, runs = pools
  for run in runs.values():
    assert run["output_tokens"] == sum(o for _, o in workload)  # every request finished
    assert 0 < run["pool_utilization"] <= run["utilization"] <= 1
  contiguous, paged = runs["contiguous"], runs["paged"]
  assert contiguous["max_running"] == 4096 // 512  # one max-length region each
  assert contiguous["preemptions"] == 0  # the whole reservation comes at admission
  # Pages waste at most the partial last page of each request.
  assert 1 - paged["utilization"] < 16 / min(p for p, _ in workload)
  assert paged["utilization"] > 0.9 > contiguous["utilization"]
  # A reservation is max_model_len; no request ever holds more than its length.
  assert contiguous["utilization"] <= max(p + o for p, o in workload) / 512
  assert paged["mean_running"] > contiguous["mean_running"]
  assert paged["steps"] < contiguous["steps"]


def test_first_fit_pool_holes():
  pool = counts.FirstFitPool(10)
  assert [pool.allocate(name, 3) for name in "abc"] == [0, 3, 6]
  assert pool.allocate("d", 2) is None  # 1 token left
  pool.free("b")
  assert pool.holes() == [(3, 3), (9, 1)]
  assert pool.allocate("e", 4) is None  # 4 free, no run of 4
  with pytest.raises(ValueError, match="'a' is already allocated"):
    pool.allocate("a", 1)


def test_fragmentation_trace_is_the_seed_example():
  trace = counts.fragmentation_trace(num_requests=16, unit_tokens=8192, page_size=16)
  # 8 of 16 units free (8 "GB" at 1 GiB per unit), none contiguous for 2 units.
  assert trace["free_tokens"] == 8 * 8192 and trace["num_holes"] == 8
  assert trace["largest_hole"] == 8192 < trace["request_tokens"] == 2 * 8192
  assert not trace["contiguous_fits"]
  assert trace["paged_pages"] == 2 * 8192 // 16 and trace["paged_runs"] >= 2


# -- C11 ------------------------------------------------------------------------


def test_mtp_pool_tokens():
  qwen = get_preset("qwen3.5-9b")  # 8 full-attention layers + 1 MTP layer cached
  pool = 188847 * 32768
  assert counts.mtp_pool_tokens(qwen, pool) == dict(off=188847, on=167864,
                                                    change=pytest.approx(-1 / 9, abs=1e-5))
  assert counts.mtp_pool_tokens(get_preset("tiny-code"), 6 * 2**20)["change"] == pytest.approx(
      -1 / 3, abs=1e-5)
  assert counts.mtp_pool_tokens(counts.deepseek_v3_like(), pool)["change"] == pytest.approx(
      -1 / 62, abs=1e-5)
  with pytest.raises(ValueError, match="'llama3-8b' has no MTP"):
    counts.mtp_pool_tokens(get_preset("llama3-8b"), pool)


# -- report ---------------------------------------------------------------------


def test_report_normalizes_devices_and_claim_ids():
  assert report._device("gpu:NVIDIA H200") == "GPU NVIDIA H200"
  assert report._device("CPU x86_64 x2") == "CPU, 2 cores"
  assert report._device("CPU x86_64 x2 (Intel Xeon Processor)") == (
      "CPU, 2 cores, Intel Xeon Processor")
  assert report._device({"platform": "cpu", "cpu_count": 2, "num_devices": 8,
                         "cpu_model": "AMD EPYC 9R14"}) == "CPU, 2 cores, AMD EPYC 9R14, 8 fake devices"
  assert report._device("x86_64 CPU, 2 cores, Linux") == "CPU, 2 cores"
  assert report._device(None) == "none (arithmetic)"
  assert report._claim_ids("C15/issue") == ["C15"] and report._claim_ids("issue") == []


def test_report_on_committed_results(tmp_path):
  out = tmp_path / "REPORT.md"
  subprocess.run([sys.executable, "-m", "experiments.report",
                  f"--results_dir={os.path.join(REPO, 'results')}", f"--out={out}"],
                 cwd=REPO, check=True, capture_output=True, timeout=60)
  rows = [line for line in out.read_text().splitlines() if line.startswith("| C")]
  summary = [line.split("|")[1].strip() for line in rows[:len(report.CLAIMS)]]
  assert summary == list(report.CLAIMS) == [f"C{i}" for i in range(1, 19)]
