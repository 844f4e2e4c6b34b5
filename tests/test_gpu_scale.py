"""experiments/gpu_scale.py end to end on the runlocal config (issue 16's dry run),
checked against hand counts, HF transformers and the script's own invariants."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import kvjax
from configs import gpu_scale as gpu_scale_config
from experiments import gpu_scale
from experiments.hf_peer import hf_generate, to_hf_on_device
from kvjax import cli_bench


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(config, the JSON as written) of one runlocal run, trimmed to fit the test budget:
  the reference backend throughout (the interpret-mode kernel runs in the full dry run)."""
  cfg = gpu_scale_config.get_config("runlocal")
  cfg.out_dir = str(tmp_path_factory.mktemp("gpu_scale"))
  cfg.backend = "reference"
  cfg.engine_runs = ((16, 6, 3),)
  cfg.decode_contexts = (64,)
  cfg.quant_batches = (1,)
  cfg.invariance_backends = ("reference",)
  gpu_scale.run(cfg)
  with open(os.path.join(cfg.out_dir, cfg.name + ".json")) as f:
    return cfg, json.load(f)


def test_every_section_ran_and_files_written(run):
  cfg, report = run
  assert report["status"] == {name: "ok" for name in cfg.sections}
  assert set(report["section_seconds"]) == set(cfg.sections)
  assert report["device"].startswith("CPU")
  assert os.path.getsize(os.path.join(cfg.out_dir, cfg.name + ".png")) > 0
  assert {row["claim"] for row in report["claims"]} == {"C9", "C12"}  # no batch 10 here
  assert all(set(row) == {"goal", "target", "ours", "met"} for row in report["goals"])


def test_model_bytes_by_hand(run):
  """Weights one decode step reads (all but the embedding table; untied head) and KV
  bytes per token, counted from the tiny llama3-shaped config's dimensions."""
  cfg, report = run
  m = cfg.model_overrides
  d, f, n, k, h = m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim
  per_layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f + 2 * d  # q, o, k, v, mlp, 2 norms
  bf16 = 2
  assert report["init"]["decode_step_weight_bytes"] == bf16 * (
      m.num_layers * per_layer + d + d * m.vocab_size)
  assert report["init"]["kv_bytes_per_token"] == 2 * m.num_layers * k * h * bf16
  assert report["init"]["num_params"] == m.num_layers * per_layer + d + 2 * d * m.vocab_size


def test_bandwidth_utilization_arithmetic(run):
  """(weights + KV at the mean context) / step time / 4.8 TB/s, recomputed from the
  JSON's own step times and the hand byte counts above."""
  cfg, report = run
  weights, kv = report["init"]["decode_step_weight_bytes"], report["init"]["kv_bytes_per_token"]
  for context in cfg.decode_contexts:
    row = report["decode"][str(context)]
    assert row["prompt_len"] == context - cfg.decode_new_tokens
    mean_context = row["prompt_len"] + cfg.decode_new_tokens / 2
    expected = (weights + kv * mean_context) / row["tpot_s"] / 4.8e12
    assert row["bandwidth_utilization"] == pytest.approx(expected, rel=1e-12)
    assert row["tokens_per_s"] == pytest.approx(1 / row["tpot_s"])
  for batch in cfg.decode_batches:
    row = report["steps"][str(batch)]
    expected = (weights + kv * cfg.step_context * batch) / row["decode_step_s"] / 4.8e12
    assert row["bandwidth_utilization"] == pytest.approx(expected, rel=1e-12)
    assert row["verify_over_decode"] == pytest.approx(row["verify_step_s"] /
                                                      row["decode_step_s"])


def test_quantized_weights_read_fewer_bytes(run):
  _, report = run
  quant = report["quant"]
  bf16 = quant["bf16"]["decode_step_weight_bytes"]
  assert bf16 > quant["int8"]["decode_step_weight_bytes"] > quant["int4-g128"][
      "decode_step_weight_bytes"]
  assert all(row["batch1_tokens_per_s"] > 0 for row in quant.values())


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
  sessions = cli_bench.make_workload(
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
  assert all(row["tokens_per_s"] > 0 for row in report["hf"].values())


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
