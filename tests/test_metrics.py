"""Serving metrics follow vLLM's definitions, checked on hand-made timelines."""
from __future__ import annotations

import pytest

from kvjax.engine.metrics import RequestMetrics, StepLog, distribution, summarize


def _request(arrival, times, **kwargs):
  r = RequestMetrics("r", prompt_len=10, arrival_s=arrival, **kwargs)
  for t in times:
    r.record_tokens(1, t)
  return r


def test_ttft_tpot_itl_e2e_by_hand():
  # Arrives at 1.0; tokens at 1.5, 1.7, 2.0, 2.1.
  r = _request(1.0, [1.5, 1.7, 2.0, 2.1])
  assert r.ttft_s == pytest.approx(0.5)
  assert r.e2e_s == pytest.approx(1.1)
  assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)  # (latency - TTFT) / (output_len - 1)
  assert r.itls_s == pytest.approx([0.2, 0.3, 0.1])
  assert _request(0.0, [0.4]).tpot_s is None  # one token: no TPOT


def test_verify_steps_give_acceptance_per_position():
  r = RequestMetrics("r", prompt_len=4, arrival_s=0.0)
  r.record_verify(num_draft=2, num_accepted=2, num_positions=2)  # 3 tokens
  r.record_verify(num_draft=2, num_accepted=0, num_positions=2)  # 1 token
  r.record_verify(num_draft=1, num_accepted=1, num_positions=2)  # 2 tokens
  r.record_tokens(6, 1.0)
  steps = StepLog()
  steps.record(waiting=2, running=1, utilization=0.5, pages_used=3, batched_tokens=3,
               step_s=0.5, decode_only=False)
  steps.record(waiting=0, running=1, utilization=0.25, pages_used=1, batched_tokens=3,
               step_s=0.25, decode_only=True)
  steps.record(waiting=0, running=1, utilization=0.25, pages_used=1, batched_tokens=3,
               step_s=1.0, decode_only=True, num_steps=4)  # a 4-step burst
  s = summarize([r], steps, wall_s=2.0, prefix_hit_tokens=16, prefix_queried_tokens=64,
                num_preemptions=1)
  assert s["acceptance_length"] == pytest.approx(6 / 3) == r.acceptance_length
  assert RequestMetrics("plain", prompt_len=4, arrival_s=0.0).acceptance_length is None
  assert s["acceptance_rate_per_position"] == pytest.approx([2 / 3, 1 / 2])
  assert s["acceptance_rate"] == pytest.approx(3 / 5)
  assert s["tokens_per_s"] == pytest.approx(3.0) and s["request_throughput"] == 0.5
  assert s["prefix_hit_rate"] == 0.25 and s["kv_pages_used"] == 3
  assert s["queue_depth"]["mean"] == 2 / 3 and s["num_preemptions"] == 1
  assert s["decode_step_s"]["mean"] == 0.25  # the prefill step does not count, a burst per step


def test_same_step_itl_share_drafts_per_step_and_no_acceptance_without_drafts():
  # Tokens at 1.0, 1.0, 1.0 (one burst), then 2.0: ITLs 0, 0, 1 -> 2 of 3 in one step.
  r = _request(0.5, [1.0, 1.0, 1.0, 2.0])
  steps = StepLog()
  for k, decode in ((2, False), (2, True), (0, True), (0, True), (1, True)):
    steps.record(waiting=0, running=1, utilization=0.1, pages_used=1, batched_tokens=1,
                 step_s=0.1, decode_only=decode, num_draft=k)
  s = summarize([r], steps, wall_s=1.5, prefix_hit_tokens=0, prefix_queried_tokens=0,
                num_preemptions=0)
  assert s["itl_same_step_fraction"] == pytest.approx(2 / 3)
  assert s["decode_steps_by_num_draft"] == {0: 2, 1: 1, 2: 1}
  assert s["acceptance_length"] is None  # nothing was verified


def test_distribution_mean_median_p99():
  d = distribution(range(101))
  assert (d["mean"], d["median"], d["p99"]) == (50.0, 50.0, 99.0)
  assert distribution([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_step_log_stays_bounded_and_hands_back_a_run():
  log = StepLog(max_steps=4)

  def record(i):
    log.record(waiting=i, running=0, utilization=0.0, pages_used=0, batched_tokens=0,
               step_s=float(i), decode_only=True)

  for i in range(3):
    record(i)
  mark = log.num_recorded
  for i in range(3, 6):
    record(i)
  run = log.since(mark)
  assert run.step_s == [3.0, 4.0, 5.0] and run.queue_depth == [3, 4, 5]
  for i in range(6, 20):
    record(i)
  assert len(log.step_s) < 8 and log.num_recorded == 20
  assert log.since(17).step_s == [17.0, 18.0, 19.0]
  with pytest.raises(ValueError, match="no longer kept"):
    log.since(mark)
