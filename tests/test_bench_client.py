"""The HTTP bench client (kvjax/server/bench/client.py): arrivals, goodput, and agreement with the server.

Arrival gaps are checked against the gamma law (mean 1/rate, CV 1/sqrt(shape))
with few-sigma bounds and scipy's KS test; the end-to-end test runs the real
server on 127.0.0.1 (ephemeral port) and checks the client's counts against
/metrics exactly (and against the requests' own max_tokens, EOS off) and its
mean TTFT / E2E against the server's histograms.
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from scipy import stats

import kvjax
from kvjax.engine.config import EngineConfig
from kvjax.server import serve_in_thread
from kvjax.server.bench import client as bench_client
from kvjax.server.bench import workloads as bench_workloads
from kvjax.server.bench import diagnose
from kvjax.text.tokenizer import ByteTokenizer

ENCODE = ByteTokenizer().encode

N_GAPS = 20_000


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (10.0, 0.25), (2.0, 4.0)])
def test_arrival_gaps_follow_gamma(rate, burstiness):
  gaps = bench_client.arrival_gaps(N_GAPS, rate, burstiness, np.random.default_rng(1))
  shape, scale = burstiness, 1.0 / (rate * burstiness)
  mean, var = shape * scale, shape * scale**2
  # Standard errors of the sample mean and sample variance of a gamma(k, theta):
  # var(mean) = k theta^2 / N; var(s^2) ~ (mu4 - sigma^4) / N with mu4 = 3k(k + 2) theta^4.
  assert abs(gaps.mean() - 1.0 / rate) < 5 * math.sqrt(var / N_GAPS)
  se_var = scale**2 * math.sqrt((2 * shape**2 + 6 * shape) / N_GAPS)
  assert abs(gaps.var() - var) < 5 * se_var
  cv = gaps.std() / gaps.mean()
  assert abs(cv - 1 / math.sqrt(burstiness)) < 0.1 / math.sqrt(burstiness)
  assert stats.kstest(gaps, stats.gamma(a=shape, scale=scale).cdf).pvalue > 1e-4


def test_poisson_counts_per_window():
  # burstiness 1 is a Poisson process: arrivals per unit window ~ Poisson(rate).
  rate = 6.0
  times = np.cumsum(bench_client.arrival_gaps(N_GAPS, rate, 1.0, np.random.default_rng(2)))
  counts = np.bincount(times[times < math.floor(times[-1])].astype(int))
  assert abs(counts.mean() - rate) < 5 * math.sqrt(rate / len(counts))
  assert abs(counts.var() / counts.mean() - 1.0) < 0.15  # Poisson: dispersion 1


def test_infinite_rate_sends_everything_at_once():
  assert not bench_client.arrival_gaps(7, math.inf, 3.0).any()


@pytest.mark.parametrize("rate, burstiness, match", [(0.0, 1.0, "request_rate.*0.0"),
                                                     (-2.0, 1.0, "request_rate.*-2.0"),
                                                     (1.0, 0.0, "burstiness.*0.0"),
                                                     (1.0, math.inf, "burstiness.*inf")])
def test_arrival_gaps_reject_bad_values(rate, burstiness, match):
  with pytest.raises(ValueError, match=match):
    bench_client.arrival_gaps(3, rate, burstiness)


def test_parse_goodput():
  assert bench_client.parse_goodput(["ttft:200", "tpot:20", "e2el:1500"]) == {
      "ttft": 0.2, "tpot": 0.02, "e2el": 1.5}
  for bad, match in (("ttft", "KEY:MS"), ("itl:5", "itl:5"), ("ttft:abc", "'abc'"),
                     ("tpot:-1", "> 0")):
    with pytest.raises(ValueError, match=match):
      bench_client.parse_goodput([bad])


def _record(ttft, tpot, e2e, output_tokens=4, prompt_tokens=10, success=True):
  return bench_client.RequestRecord(0, 0, 0.0, prompt_tokens, success=success,
                                    output_tokens=output_tokens, ttft_s=ttft, tpot_s=tpot,
                                    e2e_s=e2e, itls_s=[tpot] * (output_tokens - 1))


def test_summarize_counts_and_goodput_by_hand():
  records = [_record(0.1, 0.01, 0.13), _record(0.3, 0.01, 0.33),  # TTFT misses 0.2
             _record(0.1, 0.05, 0.25), _record(0.15, 0.02, 0.21),  # TPOT misses 0.03
             _record(None, None, None, 0, success=False)]
  summary = bench_client.summarize(records, 2.0, {"ttft": 0.2, "tpot": 0.03})
  assert summary["completed"] == 4 and summary["failed"] == 1
  assert summary["goodput"] == pytest.approx(2 / 2.0)
  assert summary["request_throughput"] == pytest.approx(4 / 2.0)
  assert summary["output_throughput"] == pytest.approx(16 / 2.0)
  assert summary["total_token_throughput"] == pytest.approx(56 / 2.0)
  assert summary["ttft"]["mean"] == pytest.approx((0.1 + 0.3 + 0.1 + 0.15) / 4)
  assert summary["e2el"]["median"] == pytest.approx((0.21 + 0.25) / 2)
  assert bench_client.summarize(records, 2.0, {})["goodput"] is None


# -- against the real server -----------------------------------------------------

MAX_CONCURRENCY = 3


@pytest.fixture(scope="module")
def served():
  """The default model (EOS off: every answer is max_tokens long) on 127.0.0.1:<ephemeral>."""
  model = kvjax.load_checkpoint()
  model = dataclasses.replace(model, config=model.config.replace(eos_token_id=None))
  # One step per engine call: the engine loop admits arrivals between calls, so a
  # 16-step burst would hold a new request up to 16 steps before the server's
  # clocks start (the client's TTFT would then lead the server's by that much).
  config = EngineConfig(page_size=16, max_num_seqs=4, max_num_batched_tokens=128,
                        max_model_len=256, num_scheduler_steps=1)
  with serve_in_thread(model, config) as server:
    # Compile the shapes the tests use, so neither side's latencies hold compiles.
    bench_client.run_benchmark(server.url, _random_sessions(seed=99), encode=ENCODE,
                               max_concurrency=MAX_CONCURRENCY, metrics_interval_s=None)
    yield server


def _random_sessions(seed, num=8):
  return bench_workloads.make_workload("random", vocab_size=259, num_requests=num, input_len=24,
                                 output_len=128, range_ratio=0.5, seed=seed)


def _window(server, fn):
  first = diagnose.parse_metrics(diagnose.scrape(server.url))
  out = fn()
  last = diagnose.parse_metrics(diagnose.scrape(server.url))
  return out, first, last


def _hist_mean(first, last, name):
  _, _, s1, n1 = last.histograms[name]
  _, _, s0, n0 = first.histograms[name]
  return (s1 - s0) / (n1 - n0)


def test_counts_and_latencies_agree_with_server_metrics(served):
  sessions = _random_sessions(seed=1)
  result, first, last = _window(served, lambda: bench_client.run_benchmark(
      served.url, sessions, max_concurrency=MAX_CONCURRENCY, goodput={"e2el": 60.0},
      metrics_interval_s=0.05))
  summary, records = result["summary"], result["requests"]
  delta = {k: last.counters[k] - first.counters.get(k, 0.0)
           for k in ("request_success", "generation_tokens", "prompt_tokens")}
  assert summary["completed"] == len(sessions) == delta["request_success"]
  assert summary["failed"] == 0
  assert summary["goodput"] == pytest.approx(summary["request_throughput"])
  expected_out = sum(s.max_new_tokens for s in sessions)  # EOS off: exactly max_tokens each
  assert summary["total_output_tokens"] == expected_out == delta["generation_tokens"]
  expected_in = sum(len(s.turns[0]) for s in sessions)
  assert summary["total_input_tokens"] == expected_in == delta["prompt_tokens"]
  # Client-side means vs the server's own histograms.  The client's clock starts
  # before the server's (request sent < engine arrival) and stops after it (token
  # made < chunk received), so it reads the server's time plus HTTP and the event
  # loops (10-50 ms here: client and server share a busy 2-core CPU).  A TTFT taken
  # from the bench start (the concurrency gate's wait), or at the last token, or an
  # E2E from the bench start, would be off by more than twice the bound; the last
  # two asserts check that here.
  ttft_server = _hist_mean(first, last, "time_to_first_token_seconds")
  e2e_server = _hist_mean(first, last, "e2e_request_latency_seconds")
  bound = 0.1
  assert ttft_server <= summary["ttft"]["mean"] < ttft_server + bound
  assert e2e_server - 0.005 <= summary["e2el"]["mean"] < e2e_server + bound
  assert e2e_server - ttft_server > 2 * bound
  assert np.mean([r["start_s"] for r in records]) > 2 * bound
  # The server ran as many requests as the client allowed, never more; a sampler
  # that waited for a request's connection would only see it between requests.
  running = [s["num_requests_running"] for s in result["server_metrics"]["samples"]]
  assert max(running) == MAX_CONCURRENCY


def test_multi_turn_history_and_poisson_starts(served):
  sessions = bench_workloads.make_workload("multi-turn-chat", vocab_size=259, num_requests=3,
                                     input_len=20, output_len=10, num_turns=3, seed=3)
  rate, seed = 2.0, 5  # gaps of 0.5 s on average, far above the event loop's lag
  result, first, last = _window(served, lambda: bench_client.run_benchmark(
      served.url, sessions, request_rate=rate, encode=ENCODE, seed=seed,
      metrics_interval_s=None))
  assert result["summary"]["completed"] == 9
  scheduled = np.cumsum(bench_client.arrival_gaps(3, rate, 1.0, np.random.default_rng(seed)))
  for index, session in enumerate(sessions):
    turns = sorted((r for r in result["requests"] if r["session"] == index),
                   key=lambda r: r["turn"])
    # A chat starts at its arrival (no concurrency cap; the client shares a busy
    # CPU with the server, so its timers may fire late) ...
    assert 0 <= turns[0]["start_s"] - scheduled[index] < 0.15
    history = 0
    for turn, record in enumerate(turns):
      # ... each turn sends the history: earlier messages and answers, as the
      # server's usage counts them, and starts after the previous turn ended.
      history += len(session.turns[turn])
      assert record["prompt_tokens"] == history
      history += len(ENCODE(record["text"]))
      if turn:
        previous = turns[turn - 1]
        assert record["start_s"] >= previous["start_s"] + previous["e2e_s"]
  # Every later turn begins with its previous request (>= 30 ids: a full 16-id block).
  assert last.counters["prefix_cache_hits"] - first.counters["prefix_cache_hits"] >= 16 * 6


def test_cli_bench_url_then_diagnose(served, tmp_path, capsys):
  from kvjax.cli import main as cli

  assert cli.main(["bench", "--url", served.url, "--workload", "random", "--num-prompts", "4",
                   "--input-len", "16", "--output-len", "8", "--request-rate", "50",
                   "--max-concurrency", "2", "--goodput", "ttft:5000", "tpot:1000",
                   "--out-dir", str(tmp_path)]) == 0
  stem = tmp_path / "bench_http_random"
  assert (stem.with_suffix(".png")).stat().st_size > 0
  bench = json.loads(stem.with_suffix(".json").read_text())
  assert bench["summary"]["completed"] == 4 and bench["summary"]["goodput"] > 0
  capsys.readouterr()
  runs = {"healthy": ("5000", "1000"), "concurrency": ("0.001", "0.001")}
  for kind, (ttft_ms, tpot_ms) in runs.items():
    assert cli.main(["diagnose", "--bench-json", str(stem.with_suffix(".json")), "--ttft-ms",
                     ttft_ms, "--tpot-ms", tpot_ms, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["diagnosis"]["kind"] == kind
    assert out["signals"]["num_requests"] == 4
    assert out["signals"]["max_num_seqs"] == 4  # the server's kvjax:max_num_seqs gauge
    prompts = sorted(r["prompt_tokens"] for r in bench["requests"])
    assert out["signals"]["input_tokens_mean"] == pytest.approx(np.mean(prompts))
  # A live window with no traffic: nothing finished, nothing running, idle (not "healthy").
  assert cli.main(["diagnose", "--url", served.url, "--window", "0.4", "--interval", "0.2",
                   "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["signals"]["num_requests"] == 0 and out["signals"]["running"] == 0
  assert out["signals"]["max_num_seqs"] == 4 and out["diagnosis"]["kind"] == "idle"
