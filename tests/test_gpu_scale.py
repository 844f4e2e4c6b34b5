"""experiments/gpu_scale.py end to end on the runlocal config (issue 16's dry run),
checked against hand counts, HF transformers and the script's own invariants."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from configs import gpu_scale as gpu_scale_config
from experiments import gpu_scale
from experiments.hf_peer import hf_generate, to_hf_on_device
from kvjax.server.bench import workloads as bench_workloads


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(config, the JSON as written) of one runlocal run, trimmed to fit the test budget:
  the reference backend throughout (the interpret-mode kernel runs in the full dry run).
  The script runs as its command line does, in a subprocess whose XLA compiles at LLVM
  -O0: the tiny model's run is compile bound (-O0 halves each compile), its timings mean
  nothing, and what is checked (counts, bits, tokens) does not depend on it."""
  cfg = gpu_scale_config.get_config("runlocal")
  cfg.out_dir = str(tmp_path_factory.mktemp("gpu_scale"))
  cfg.backend = "reference"
  cfg.engine_runs = ((16, 6, 3),)
  cfg.decode_contexts = (64,)
  cfg.quant_batches = (1,)
  cfg.invariance_backends = ("reference",)
  overrides = [f"--config.{key}={getattr(cfg, key)!s}" for key in (
      "out_dir", "backend", "engine_runs", "decode_contexts", "quant_batches",
      "invariance_backends")]
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                     " --xla_backend_optimization_level=0")}
  proc = subprocess.run([sys.executable, "-m", "experiments.gpu_scale",
                         "--config=configs/gpu_scale.py:runlocal", *overrides], cwd=_ROOT,
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(cfg.out_dir, cfg.name + ".json")) as f:
    report = json.load(f)
  # The run used this config (what the tests below read), overrides and all.
  assert report["config"] == json.loads(json.dumps(cfg.to_dict()))
  return cfg, report


def test_every_section_ran_and_files_written(run):
  cfg, report = run
  assert report["status"] == {name: "ok" for name in cfg.sections}
  assert set(report["section_seconds"]) == set(cfg.sections)
  assert report["device"].startswith("CPU")
  assert os.path.getsize(os.path.join(cfg.out_dir, cfg.name + ".png")) > 0
  assert {row["claim"] for row in report["claims"]} == {"C9", "C12"}  # no batch 10 here
  assert all(set(row) == {"goal", "target", "ours", "met"} for row in report["goals"])


def _step_weight_bytes_by_hand(m, bits: int = 16, group=None) -> int:
  """Weights one decode step reads (all but the embedding table; untied head), counted
  from the config's dimensions: each matrix [I, O] (q, k, v, o, gate, up, down, head)
  at `bits` per weight plus, quantized, an f32 scale per output and group of inputs
  (group None: one group); the norms stay bf16."""
  d, f, n, k, h = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
  matrices = [(d, n * h), (d, k * h), (d, k * h), (n * h, d), (d, f), (d, f), (f, d)]

  def matrix(i, o):
    return i * o * bits // 8 + (0 if bits == 16 else -(-i // (group or i)) * o * 4)

  norms = 2 * (2 * d * m.num_layers + d)
  return m.num_layers * sum(matrix(i, o) for i, o in matrices) + norms + matrix(d, m.vocab_size)


def _kv_bytes_per_token_by_hand(m) -> int:
  return 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2  # K and V, bf16


def test_model_bytes_by_hand(run):
  cfg, report = run
  m = cfg.model_overrides
  d, f, n, k, h = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
  per_layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f + 2 * d  # q, o, k, v, mlp, 2 norms
  assert report["init"]["decode_step_weight_bytes"] == _step_weight_bytes_by_hand(m)
  assert report["init"]["kv_bytes_per_token"] == _kv_bytes_per_token_by_hand(m)
  assert report["init"]["num_params"] == m.num_layers * per_layer + d + 2 * d * m.vocab_size


def test_bandwidth_utilization_arithmetic(run):
  """(weights + KV at the mean context) / step time / 4.8 TB/s from the hand byte counts
  (not the report's) and the hand mean context; the step times are the measurement."""
  cfg, report = run
  weights = _step_weight_bytes_by_hand(cfg.model_overrides)
  kv = _kv_bytes_per_token_by_hand(cfg.model_overrides)
  for context in cfg.decode_contexts:
    row = report["decode"][str(context)]
    assert row["prompt_len"] == context - cfg.decode_new_tokens
    mean_context = context - cfg.decode_new_tokens / 2  # the prompt, then half the new tokens
    assert row["step_bytes"] == weights + kv * mean_context
    expected = (weights + kv * mean_context) / row["tpot_s"] / 4.8e12
    assert row["bandwidth_utilization"] == pytest.approx(expected, rel=1e-12)
    assert row["tokens_per_s"] == pytest.approx(1 / row["tpot_s"])
  for batch in cfg.decode_batches:
    row = report["steps"][str(batch)]
    expected = (weights + kv * cfg.step_context * batch) / row["decode_step_s"] / 4.8e12
    assert row["bandwidth_utilization"] == pytest.approx(expected, rel=1e-12)
    assert row["verify_over_decode"] == pytest.approx(row["verify_step_s"] /
                                                      row["decode_step_s"])


def test_quantized_weights_read_the_bytes_counted_by_hand(run):
  cfg, report = run
  m = cfg.model_overrides
  want = {"bf16": _step_weight_bytes_by_hand(m), "int8": _step_weight_bytes_by_hand(m, 8),
          "int4-g128": _step_weight_bytes_by_hand(m, 4, 128)}
  assert {name: row["decode_step_weight_bytes"] for name, row in report["quant"].items()} == want
  for row in report["quant"].values():  # every variant timed at every batch
    assert {f"batch{b}_step_s" for b in cfg.quant_batches} <= set(row)


def test_logits_batch_invariant_bit_for_bit(run):
  """Row 0 among padding rows or among mixed prompts of the same shapes: equal bits."""
  cfg, report = run
  assert set(report["invariance"]) == set(cfg.invariance_backends)
  for row in report["invariance"].values():
    for phase in ("prefill", "decode"):
      assert row[f"{phase}_mixed_equals_padded"] is True
      assert row[f"{phase}_max_abs_diff_vs_padded"] == 0.0


def test_engine_served_every_requested_token(run):
  """Exact counts from the workload generator (no EOS), and greedy engine tokens equal
  batch-1 kvjax.generate's."""
  cfg, report = run
  (input_len, output_len, concurrency), = cfg.engine_runs
  sessions = bench_workloads.make_workload(
      "random", vocab_size=cfg.model_overrides.vocab_size, num_requests=concurrency,
      input_len=input_len, output_len=output_len, range_ratio=cfg.range_ratio, seed=cfg.seed)
  row = report["engine"][f"{input_len}/{output_len}@{concurrency}"]
  assert row["num_requests"] == concurrency
  assert row["num_generated_tokens"] == sum(s.max_new_tokens for s in sessions)
  assert row["tokens_per_s"] == pytest.approx(row["num_generated_tokens"] / row["wall_s"])
  for key in ("ttft", "tpot"):
    assert 0 < row[key]["median"] <= row[key]["p99"]
  assert 0 <= row["itl"]["median"] <= row["itl"]["p99"]  # multi-step: tokens come in bursts
  checks = report["engine_vs_generate"]
  assert len(checks) == cfg.equality_requests
  assert all(c["common_prefix"] == c["tokens"] > 0 for c in checks)


def test_hf_peer_ran_every_mode(run):
  cfg, report = run
  assert set(report["hf"]) == {f"{mode}@{batch}" for mode in cfg.hf_modes
                               for batch in (1, cfg.hf_batch)}
  failed = {key: row["error"] for key, row in report["hf"].items() if "error" in row}
  assert not failed  # the section records a mode that raised and goes on


@pytest.fixture(scope="module")
def f32_pair():
  """A float32 llama3-shaped tiny model and its HF twin sharing the buffers."""
  cfg = gpu_scale_config.get_config("runlocal")
  config = gpu_scale.model_config(cfg)
  model = kvjax.Model(config, gpu_scale.init_on_device(config, np.float32, 0))
  return model, to_hf_on_device(model)


def test_hf_twin_matches_kvjax_forward(f32_pair):
  """The DLPack-shared HF model is the same function as kvjax's forward (HF as oracle)."""
  import torch

  model, hf = f32_pair
  tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 40))
  ours = np.asarray(kvjax.forward(model, tokens))
  with torch.inference_mode():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)


def test_hf_generate_left_padding_matches_kvjax_greedy(f32_pair):
  model, hf = f32_pair
  prompts = [[5, 9, 11, 40, 7], [300, 12]]
  for mode in ("sdpa", "static"):
    ids = hf_generate(hf, prompts, 6, mode)
    assert ids.tolist() == kvjax.generate(model, prompts, 6).tokens


def test_hf_twin_refuses_what_it_cannot_build():
  model = kvjax.load_checkpoint("tiny")
  with pytest.raises(ValueError, match="qk_norm"):
    to_hf_on_device(kvjax.Model(model.config.replace(qk_norm=True), model.params))
