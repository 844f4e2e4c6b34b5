"""C18 diagnosis (kvjax/server/bench/diagnose.py) on synthetic /metrics made by prometheus_client itself.

Each scenario observes known per-request numbers into a real prometheus_client
registry with the server's metric names, renders it with generate_latest,
and checks the kind of slow, the seed's ordered actions and the numbers
(means, bucket-resolution P95) worked out here from the scenario's own lists.
"""
from __future__ import annotations

import argparse
import json

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
import pytest

from kvjax.cli import diagnose as cli_diagnose
from kvjax.server.bench import diagnose

PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048)
TARGETS = diagnose.Targets(ttft_s=0.2, tpot_s=0.02)


class FakeServer:
  """The server's metric families in a private registry."""

  def __init__(self, max_num_seqs=None):
    self.registry = r = CollectorRegistry()
    label = ["model_name"]
    self.running = Gauge("kvjax:num_requests_running", "", label, registry=r)
    self.waiting = Gauge("kvjax:num_requests_waiting", "", label, registry=r)
    self.kv = Gauge("kvjax:kv_cache_usage_perc", "", label, registry=r)
    if max_num_seqs is not None:
      Gauge("kvjax:max_num_seqs", "", label, registry=r).labels("m").set(max_num_seqs)
    self.queries = Counter("kvjax:prefix_cache_queries", "", label, registry=r)
    self.hits = Counter("kvjax:prefix_cache_hits", "", label, registry=r)
    self.preemptions = Counter("kvjax:num_preemptions", "", label, registry=r)
    self.success = Counter("kvjax:request_success", "", label + ["finished_reason"], registry=r)
    seconds = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    self.ttft = Histogram("kvjax:time_to_first_token_seconds", "", label, buckets=seconds,
                          registry=r)
    self.tpot = Histogram("kvjax:time_per_output_token_seconds", "", label, buckets=seconds,
                          registry=r)
    self.queue = Histogram("kvjax:request_queue_time_seconds", "", label, buckets=seconds,
                           registry=r)
    self.e2e = Histogram("kvjax:e2e_request_latency_seconds", "", label, buckets=seconds,
                         registry=r)
    self.prompt = Histogram("kvjax:request_prompt_tokens", "", label, buckets=PROMPT_BUCKETS,
                            registry=r)

  def finish(self, *, prompt, ttft, tpot, queue, hit=0):
    m = "m"
    self.prompt.labels(m).observe(prompt)
    self.ttft.labels(m).observe(ttft)
    self.tpot.labels(m).observe(tpot)
    self.queue.labels(m).observe(queue)
    self.e2e.labels(m).observe(ttft + 31 * tpot)
    self.queries.labels(m).inc(prompt)
    self.hits.labels(m).inc(hit)
    self.success.labels(m, "length").inc()

  def gauges(self, running, waiting, kv):
    self.running.labels("m").set(running)
    self.waiting.labels("m").set(waiting)
    self.kv.labels("m").set(kv)

  def text(self):
    return generate_latest(self.registry).decode()


def window(server, load, gauge_states, max_num_seqs=None):
  """Scrape, run `load(server)` with the gauges stepping through `gauge_states`, scrape."""
  first = diagnose.parse_metrics(server.text())
  samples = [first]
  load(server)
  for state in gauge_states:
    server.gauges(*state)
    samples.append(diagnose.parse_metrics(server.text()))
  return diagnose.signals_from_window(first, samples[-1], samples[1:], max_num_seqs)


# name: (per-request (prompt, ttft, tpot, queue), gauges (running, waiting, kv), kind, actions)
SCENARIOS = {
    "healthy": ([(100, 0.05, 0.010, 0.001)] * 8, [(4, 0, 0.3)] * 2, "healthy", []),
    "prefill": ([(1500, 0.60, 0.012, 0.02)] * 8, [(4, 0, 0.5)] * 2, "prefill",
                ["input", "scheduling"]),
    "decode": ([(100, 0.05, 0.060, 0.001)] * 8, [(8, 0, 0.4)] * 2, "decode",
               ["scheduling", "kv_quant", "devices"]),
    "concurrency_both": ([(300, 0.50, 0.040, 0.1)] * 8, [(8, 3, 0.6)] * 2, "concurrency",
                         ["input", "scheduling", "devices"]),
    # Slow first tokens that are mostly queue time, a full pool, few running.
    "concurrency_queue": ([(300, 0.90, 0.015, 0.80)] * 8, [(2, 6, 0.97), (2, 6, 0.95)],
                          "concurrency", ["input", "scheduling", "kv_quant", "devices"]),
    # The same queue beside free slots, the pool's mean use dipping between requests:
    # still waiting for pages.
    "concurrency_queue_free_slots": ([(300, 0.90, 0.015, 0.80)] * 8, [(2, 6, 0.4), (1, 6, 0.6)],
                                     "concurrency", ["input", "scheduling", "kv_quant",
                                                     "devices"]),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_kind_and_actions(name):
  requests, gauges, kind, actions = SCENARIOS[name]
  server = FakeServer(max_num_seqs=8)
  server.gauges(1, 0, 0.1)
  for _ in range(3):  # before the window: must not count
    server.finish(prompt=2000, ttft=3.0, tpot=0.3, queue=2.0)

  def load(s):
    for prompt, ttft, tpot, queue in requests:
      s.finish(prompt=prompt, ttft=ttft, tpot=tpot, queue=queue)

  signals = window(server, load, gauges)
  result = diagnose.diagnose(signals, TARGETS)
  assert result.kind == kind
  assert result.actions == actions
  assert signals.num_requests == len(requests)
  assert signals.ttft_s == pytest.approx(sum(r[1] for r in requests) / len(requests))
  assert signals.tpot_s == pytest.approx(sum(r[2] for r in requests) / len(requests))
  assert signals.queue_time_s == pytest.approx(sum(r[3] for r in requests) / len(requests))
  assert signals.input_tokens_mean == pytest.approx(sum(r[0] for r in requests) / len(requests))
  assert signals.running == pytest.approx(sum(g[0] for g in gauges) / len(gauges))
  assert signals.waiting == pytest.approx(sum(g[1] for g in gauges) / len(gauges))
  assert signals.kv_utilization == pytest.approx(sum(g[2] for g in gauges) / len(gauges))
  assert signals.max_num_seqs == 8
  report = diagnose.format_report(signals, result)
  assert f"diagnosis: {kind}" in report
  for key in actions:
    assert dict(diagnose.ACTIONS)[key] in report


def test_input_p95_at_bucket_resolution():
  # 100 prompts: 90 of 100 tokens (bucket (64, 128]) and 10 of 700 (bucket (512, 1024]).
  # Rank 95 lies 5 of the 10 into (512, 1024]: 512 + 512 * 5 / 10 = 768.
  server = FakeServer()
  for prompt in [100] * 90 + [700] * 10:
    server.finish(prompt=prompt, ttft=0.05, tpot=0.01, queue=0.0)
  first = diagnose.parse_metrics(FakeServer().text())
  last = diagnose.parse_metrics(server.text())
  signals = diagnose.signals_from_window(first, last, [last], max_num_seqs=4)
  assert signals.input_tokens_p95 == pytest.approx(768.0)
  assert not signals.input_p95_exact
  assert signals.input_tokens_mean == pytest.approx((90 * 100 + 10 * 700) / 100)
  assert signals.max_num_seqs == 4  # no gauge: the caller's value
  assert signals.prefix_hit_rate == 0.0


@pytest.mark.parametrize("q, expected", [(0.5, 64.0), (0.75, 96.0), (1.0, 128.0), (0.0, 0.0)])
def test_histogram_quantile_hand_cases(q, expected):
  # 4 observations: 2 in (0, 64], 2 in (64, 128]; none beyond.
  bounds = [64.0, 128.0, float("inf")]
  assert diagnose.histogram_quantile(q, bounds, [2, 4, 4]) == pytest.approx(expected)


def test_histogram_quantile_rejects_bad_q():
  with pytest.raises(ValueError, match="1.5"):
    diagnose.histogram_quantile(1.5, [1.0], [1])


def test_targets_reject_bad_values():
  with pytest.raises(ValueError, match="ttft_s.*-1"):
    diagnose.Targets(ttft_s=-1, tpot_s=0.1)
  with pytest.raises(ValueError, match="kv_full.*1.5"):
    diagnose.Targets(ttft_s=1, tpot_s=0.1, kv_full=1.5)


def _bench_record(prompt, ttft, tpot):
  return {"success": True, "prompt_tokens": prompt, "ttft_s": ttft, "tpot_s": tpot}


def test_bench_json_exact_numbers_and_cli(tmp_path, capsys):
  prompts = list(range(100, 2100, 100))  # 20 prompts
  server = FakeServer(max_num_seqs=8)
  first = server.text()
  for p in prompts:
    server.finish(prompt=p, ttft=0.9, tpot=0.01, queue=0.7)
  server.gauges(2, 5, 0.96)
  bench = {"requests": [_bench_record(p, 0.9, 0.01) for p in prompts]
                       + [{"success": False, "prompt_tokens": 5, "ttft_s": None,
                           "tpot_s": None}],
           "server_metrics": {"first": first, "last": server.text(),
                              "samples": [{"t": 0.5, **diagnose.parse_metrics(
                                  server.text()).gauges}]}}
  signals = diagnose.signals_from_bench(bench)
  # numpy's default (linear) percentile of 100..2000 step 100: rank 0.95 * 19 = 18.05.
  assert signals.input_tokens_p95 == pytest.approx(1900 + 0.05 * 100)
  assert signals.input_p95_exact
  assert signals.num_requests == 20
  assert signals.queue_time_s == pytest.approx(0.7)
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(bench))
  parser = argparse.ArgumentParser()
  cli_diagnose.add_parser(parser.add_subparsers())
  args = parser.parse_args(["diagnose", "--bench-json", str(path), "--ttft-ms", "200",
                            "--tpot-ms", "20", "--json"])
  assert args.func(args) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["diagnosis"]["kind"] == "concurrency"
  assert out["diagnosis"]["actions"] == ["input", "scheduling", "kv_quant", "devices"]
  assert out["signals"]["running"] == 2 and out["signals"]["max_num_seqs"] == 8


def test_a_window_without_requests_is_idle_not_healthy():
  server = FakeServer(max_num_seqs=8)
  server.finish(prompt=100, ttft=0.05, tpot=0.01, queue=0.0)  # before the window only
  signals = window(server, lambda s: None, [(0, 0, 0.0)] * 2)
  result = diagnose.diagnose(signals, TARGETS)
  assert (signals.num_requests, result.kind, result.actions) == (0, "idle", [])
  report = diagnose.format_report(signals, result)
  assert "diagnosis: idle" in report and "no requests in the window" in report
  assert "healthy" not in report
