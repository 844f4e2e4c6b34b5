"""experiments/hybrid_bench.py on a shrunk runlocal config: the grown-block arithmetic
against hand counts from the preset's fields, the token recurrence it times against a
float64 per-token loop, and the prefill and snapshot sections' guards.  The chat section
(three engines to compile, over a minute on 2 cores) is left to the launcher; its
exactness guard is tests/test_hybrid.py's, its hit arithmetic `whole_block_hit`."""
from __future__ import annotations

import numpy as np
import pytest

from configs import hybrid_bench as hybrid_bench_config
from experiments import hybrid_bench
from kvjax.model.presets import get_preset
from tests.test_gated_delta import naive_delta_rule


@pytest.fixture(scope="module")
def config():
  c = hybrid_bench_config.get_config("runlocal")
  c.prefill_lens = (72,)  # two chunks of 64, the second padded
  return c


def _qwen3_5_9b_by_hand():
  """(state bytes per request, KV bytes per token) from qwen3.5-9b's published shape:
  24 Gated DeltaNet layers (conv: 3 x (2 x 16 x 128 + 32 x 128) bf16; delta state
  32 x 128 x 128 f32) and 8 full-attention layers (K and V: 4 heads x 256, bf16)."""
  conv = 3 * (2 * 16 * 128 + 32 * 128) * 2
  delta = 32 * 128 * 128 * 4
  return 24 * (conv + delta), 8 * 2 * 4 * 256 * 2


def test_grown_block_for_qwen3_5_9b_is_2048_tokens():
  state, kv = _qwen3_5_9b_by_hand()
  grown = hybrid_bench.grown_block(get_preset("qwen3.5-9b"), "bf16")
  assert (grown["state_bytes_per_request"], grown["kv_bytes_per_token"]) == (state, kv)
  assert round(state / 2**20, 1) == 49.1 and kv == 32 * 1024
  assert 1024 < state / kv <= 2048
  assert grown["block_tokens"] == 2048


# (shared prefix tokens, block tokens) -> tokens a later request reuses
WHOLE_BLOCKS = {(30, 16): 16, (40, 16): 32, (32, 16): 32, (15, 16): 0, (30, 2048): 0,
                (40, 2048): 0, (2048, 2048): 2048}


@pytest.mark.parametrize("shared, block", sorted(WHOLE_BLOCKS))
def test_whole_block_hit(shared, block):
  assert hybrid_bench.whole_block_hit(shared, block) == WHOLE_BLOCKS[(shared, block)]


def test_recurrent_prefill_is_the_per_token_rule():
  q, k, v, g, beta, state = hybrid_bench._layer_inputs(11, 3, 8, 5, seed=2)
  out, new_state = hybrid_bench._recurrent(q, k, v, g, beta, state)
  want_out, want_state = naive_delta_rule(q, k, v, g, beta, state)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_state, want_state, rtol=1e-5, atol=1e-5)


def test_prefill_section_reports_the_chunked_rules_error(config):
  """The reported chunked-vs-recurrent difference, against the chunked rule's distance
  to the float64 per-token loop (independent of the section's arithmetic): the two agree
  within the recurrence's own distance to that loop (triangle inequality)."""
  r = hybrid_bench.section_prefill(config)["by_len"]["72"]
  cfg = get_preset(config.seed_preset)
  inputs = hybrid_bench._layer_inputs(72, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                      cfg.linear_value_head_dim, config.seed)
  want, _ = naive_delta_rule(*inputs)
  chunked = np.asarray(hybrid_bench._chunked(*inputs, chunk=cfg.linear_chunk_size)[0])
  recurrent = np.asarray(hybrid_bench._recurrent(*inputs)[0])
  chunked_err, recurrent_err = np.abs(chunked - want).max(), np.abs(recurrent - want).max()
  assert abs(r["max_abs_diff_outputs"] - chunked_err) <= recurrent_err * (1 + 1e-6)
  assert 0 < r["max_abs_diff_outputs"] < config.prefill_tolerance and r["within_tolerance"]


def test_snapshot_section_is_the_per_request_state(config):
  s = hybrid_bench.section_snapshots(config)
  state, kv = _qwen3_5_9b_by_hand()
  assert s["allocated_pool"]["snapshot_bytes"] == state == s["allocated_pool"][
      "state_bytes_per_slot"]
  assert s["allocated_pool"]["kv_bytes_per_token"] == kv
  assert s["snapshots"] == 64 and s["snapshots_bytes"] == 64 * state
