"""Diagnosis of a slow service from its metrics (claim C18): which kind of slow, and what to do.

The seed's procedure: a slow first token points at prefill (prompt length,
prefix cache); slow later tokens point at decode and batching; both at once
point at concurrency.  Three numbers tell why: the input tokens (mean and
P95), KV memory utilization, and running vs configured concurrency; queue
depth and queue time complete them.  A queue is concurrency's first symptom:
requests waiting for a slot or for pages show a slow first token before their
later tokens slow down, so a slow first token that is mostly queue time is
named concurrency, not prefill.  Concurrency short of memory (a full KV pool,
or requests waiting beside free slots) adds KV quantization to the remedies;
short of slots (running = configured) it does not.

"Slow" is relative to targets the caller gives (`Targets`: TTFT and TPOT in
seconds, e.g. a few times the unloaded service's own).  Signals come from a
window of Prometheus /metrics scrapes (counters and histograms as the
window's deltas, gauges as the mean of the samples taken in it) or from a
bench JSON (kvjax.server.bench.client: exact client-side input lengths and
latencies, plus the server samples it took during the run).  The input-token
P95 from /metrics is at bucket resolution (linear interpolation within the
bucket, as Prometheus' histogram_quantile); from a bench JSON it is exact.

Configured concurrency is the gauge kvjax:max_num_seqs when the server
exports it, else the value the caller passes (`--max-num-seqs`).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Optional, Sequence

import numpy as np

__all__ = ["Snapshot", "parse_metrics", "scrape", "histogram_quantile", "Signals", "Targets",
           "signals_from_window", "signals_from_bench", "sample_window", "Diagnosis", "diagnose",
           "ACTIONS", "format_report"]

PREFIX = "kvjax:"

# The seed's remedies, in the order to try them.
ACTIONS = (
    ("input", "shorten the input or turn on the prefix cache (fewer tokens to prefill)"),
    ("scheduling", "schedule better: chunked prefill budget, max_num_seqs, multi-step decode"),
    ("kv_quant", "shrink the KV cache (int8/int4 KV pages) so more requests fit in memory"),
    ("devices", "add devices (more KV memory and compute)"),
)
# "idle": no request finished and no token came in the window, so there is nothing to judge.
KINDS = ("idle", "healthy", "prefill", "decode", "concurrency")


@dataclasses.dataclass
class Snapshot:
  """One /metrics scrape; samples summed over label sets (one served model).

  counters:   name (no prefix, no _total) -> value
  gauges:     name -> value
  histograms: name -> (bounds [upper le, ascending, +inf last], cumulative counts, sum, count)
  """

  counters: dict
  gauges: dict
  histograms: dict


def parse_metrics(text: str) -> Snapshot:
  """Prometheus text (kvjax:* families) -> Snapshot, with prometheus_client's parser."""
  from prometheus_client.parser import text_string_to_metric_families

  counters, gauges, buckets, sums, counts = {}, {}, {}, {}, {}
  for family in text_string_to_metric_families(text):
    if not family.name.startswith(PREFIX):
      continue
    name = family.name[len(PREFIX):]
    for sample in family.samples:
      if family.type == "counter" and sample.name.endswith("_total"):
        counters[name] = counters.get(name, 0.0) + sample.value
      elif family.type == "gauge":
        gauges[name] = gauges.get(name, 0.0) + sample.value
      elif family.type == "histogram":
        if sample.name.endswith("_bucket"):
          le = float(sample.labels["le"])
          per_name = buckets.setdefault(name, {})
          per_name[le] = per_name.get(le, 0.0) + sample.value
        elif sample.name.endswith("_sum"):
          sums[name] = sums.get(name, 0.0) + sample.value
        elif sample.name.endswith("_count"):
          counts[name] = counts.get(name, 0.0) + sample.value
  histograms = {}
  for name, per_le in buckets.items():
    bounds = sorted(per_le)
    histograms[name] = (bounds, [per_le[b] for b in bounds], sums.get(name, 0.0),
                        counts.get(name, 0.0))
  return Snapshot(counters, gauges, histograms)


def scrape(url: str, timeout_s: float = 5.0) -> str:
  """GET <server root>/metrics -> its text.  `url` may end in /v1 (the OpenAI base URL)."""
  import httpx

  root = url.rstrip("/")
  if root.endswith("/v1"):
    root = root[:-3]
  response = httpx.get(root + "/metrics", timeout=timeout_s)
  response.raise_for_status()
  return response.text


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float:
  """Prometheus' histogram_quantile: the q-quantile, linear within its bucket.

  The first bucket starts at 0; a quantile in the +inf bucket is the largest
  finite bound.  NaN when the histogram is empty.
  """
  if not 0 <= q <= 1:
    raise ValueError(f"quantile must be in [0, 1], got {q}")
  total = cumulative[-1] if cumulative else 0.0
  if total <= 0:
    return math.nan
  rank = q * total
  lower_bound, lower_count = 0.0, 0.0
  for bound, count in zip(bounds, cumulative):
    if count >= rank:
      if math.isinf(bound):
        return lower_bound
      if count == lower_count:
        return bound
      return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
    lower_bound, lower_count = bound, count
  return lower_bound


@dataclasses.dataclass
class Signals:
  """What the diagnosis reads; None = not measured.  Times in seconds."""

  num_requests: float  # requests finished in the window
  input_tokens_mean: Optional[float]
  input_tokens_p95: Optional[float]
  input_p95_exact: bool  # False: bucket resolution
  kv_utilization: Optional[float]  # mean used / usable pages, 0..1
  running: Optional[float]  # mean requests running
  waiting: Optional[float]  # mean queue depth
  max_num_seqs: Optional[float]  # configured concurrency
  ttft_s: Optional[float]  # mean
  tpot_s: Optional[float]  # mean
  queue_time_s: Optional[float]  # mean time waiting before admission
  prefix_hit_rate: Optional[float]  # hit / queried prompt tokens
  num_preemptions: Optional[float]


@dataclasses.dataclass(frozen=True)
class Targets:
  """When a mean counts as slow (seconds), and when the pool counts as full (0..1)."""

  ttft_s: float
  tpot_s: float
  kv_full: float = 0.9

  def __post_init__(self):
    for name in ("ttft_s", "tpot_s"):
      value = getattr(self, name)
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"target {name} must be a positive number of seconds, got {value}")
    if not 0 < self.kv_full <= 1:
      raise ValueError(f"target kv_full must be in (0, 1], got {self.kv_full}")


def _mean(values) -> Optional[float]:
  return float(np.mean(values)) if len(values) else None


def _delta_mean(first: Snapshot, last: Snapshot, name: str) -> Optional[float]:
  """Mean of a histogram's observations made between two scrapes."""
  if name not in last.histograms:
    return None
  _, _, sum1, count1 = last.histograms[name]
  _, _, sum0, count0 = first.histograms.get(name, ([], [], 0.0, 0.0))
  return (sum1 - sum0) / (count1 - count0) if count1 > count0 else None


def _counter_delta(first: Snapshot, last: Snapshot, name: str) -> Optional[float]:
  if name not in last.counters:
    return None
  return last.counters[name] - first.counters.get(name, 0.0)


def signals_from_window(first: Snapshot, last: Snapshot, gauge_samples: Sequence[Snapshot],
                        max_num_seqs: Optional[float] = None) -> Signals:
  """Signals over the window between two scrapes; gauges averaged over `gauge_samples`."""
  prompt = last.histograms.get("request_prompt_tokens")
  p95 = None
  if prompt is not None:
    bounds, cumulative, _, _ = prompt
    before = first.histograms.get("request_prompt_tokens", (bounds, [0.0] * len(bounds)))[1]
    p95 = histogram_quantile(0.95, bounds, [a - b for a, b in zip(cumulative, before)])
    p95 = None if math.isnan(p95) else p95

  def gauge(name):
    return _mean([s.gauges[name] for s in gauge_samples if name in s.gauges])

  hits = _counter_delta(first, last, "prefix_cache_hits")
  queries = _counter_delta(first, last, "prefix_cache_queries")
  configured = gauge("max_num_seqs")
  e2e = last.histograms.get("e2e_request_latency_seconds")
  finished = e2e[3] - first.histograms.get("e2e_request_latency_seconds",
                                           ([], [], 0.0, 0.0))[3] if e2e else 0.0
  return Signals(
      num_requests=finished,
      input_tokens_mean=_delta_mean(first, last, "request_prompt_tokens"),
      input_tokens_p95=p95, input_p95_exact=False,
      kv_utilization=gauge("kv_cache_usage_perc"), running=gauge("num_requests_running"),
      waiting=gauge("num_requests_waiting"),
      max_num_seqs=configured if configured is not None else max_num_seqs,
      ttft_s=_delta_mean(first, last, "time_to_first_token_seconds"),
      tpot_s=_delta_mean(first, last, "time_per_output_token_seconds"),
      queue_time_s=_delta_mean(first, last, "request_queue_time_seconds"),
      prefix_hit_rate=hits / queries if queries else None,
      num_preemptions=_counter_delta(first, last, "num_preemptions"))


def signals_from_bench(bench: Mapping, max_num_seqs: Optional[float] = None) -> Signals:
  """Signals of a kvjax.server.bench.client result: exact client-side lengths and latencies.

  The server-side numbers (KV utilization, running, queue) come from the
  /metrics scrapes the client stored, when it could take them: full texts at
  the window's ends, gauge dicts ({"t": seconds, name: value}) in between.
  """
  done = [r for r in bench["requests"] if r["success"]]
  prompts = [r["prompt_tokens"] for r in done]
  server = bench.get("server_metrics")
  if server:
    samples = [Snapshot({}, {k: v for k, v in sample.items() if k != "t"}, {})
               for sample in server["samples"]]
    signals = signals_from_window(parse_metrics(server["first"]), parse_metrics(server["last"]),
                                  samples, max_num_seqs)
  else:
    signals = Signals(0, None, None, False, None, None, None, max_num_seqs, None, None, None,
                      None, None)
  return dataclasses.replace(
      signals, num_requests=len(done), input_tokens_mean=_mean(prompts),
      input_tokens_p95=float(np.percentile(prompts, 95)) if prompts else None,
      input_p95_exact=True, ttft_s=_mean([r["ttft_s"] for r in done]),
      tpot_s=_mean([r["tpot_s"] for r in done if r["tpot_s"] is not None]))


@dataclasses.dataclass
class Diagnosis:
  """kind: one of KINDS; actions: ACTIONS keys, most relevant first; reasons: why, in words."""

  kind: str
  slow_ttft: bool
  slow_tpot: bool
  queue_bound: bool
  actions: list
  reasons: list


def diagnose(signals: Signals, targets: Targets) -> Diagnosis:
  """The seed's decision: which kind of slow, and which of its remedies apply, in order."""
  slow_ttft = signals.ttft_s is not None and signals.ttft_s > targets.ttft_s
  slow_tpot = signals.tpot_s is not None and signals.tpot_s > targets.tpot_s
  # Queue-bound: most of the first token's wait is spent before admission.
  queue_bound = (slow_ttft and signals.queue_time_s is not None
                 and signals.queue_time_s >= 0.5 * signals.ttft_s)
  reasons = []
  if slow_ttft:
    reasons.append(f"mean TTFT {signals.ttft_s * 1e3:.1f} ms > target "
                   f"{targets.ttft_s * 1e3:.1f} ms")
  if slow_tpot:
    reasons.append(f"mean TPOT {signals.tpot_s * 1e3:.2f} ms > target "
                   f"{targets.tpot_s * 1e3:.2f} ms")
  if queue_bound:
    reasons.append(f"queue time {signals.queue_time_s * 1e3:.1f} ms is "
                   f"{signals.queue_time_s / signals.ttft_s:.0%} of TTFT")
  if not signals.num_requests and signals.ttft_s is None and signals.tpot_s is None:
    kind = "idle"
    reasons.append("no requests in the window: nothing to diagnose; send traffic while it "
                   "reads (e.g. python -m kvjax bench --url URL), or widen --window")
  elif slow_ttft and (slow_tpot or queue_bound):
    kind = "concurrency"
  elif slow_ttft:
    kind = "prefill"
  elif slow_tpot:
    kind = "decode"
  else:
    kind = "healthy"
  kv_full = signals.kv_utilization is not None and signals.kv_utilization >= targets.kv_full
  if kv_full:
    reasons.append(f"KV utilization {signals.kv_utilization:.0%} >= {targets.kv_full:.0%}")
  # Requests waiting while slots are free wait for pages (the mean utilization
  # dips as requests come and go, so a queue beside free slots says it too).
  free_slots = (signals.running is not None and signals.max_num_seqs is not None
                and signals.running < signals.max_num_seqs - 0.5)
  queued = signals.waiting is not None and signals.waiting >= 0.5
  memory_bound = kv_full or (free_slots and queued)
  if kind == "concurrency" and free_slots:
    reasons.append(f"running {signals.running:.1f} < configured {signals.max_num_seqs:.0f}"
                   + (" with requests waiting: they wait for KV pages" if queued else ""))
  # The seed's order, keeping the remedies this kind of slow calls for.
  wanted = {"idle": set(), "healthy": set(), "prefill": {"input", "scheduling"},
            "decode": {"scheduling", "kv_quant", "devices"},
            "concurrency": {"input", "scheduling", "kv_quant", "devices"}}[kind]
  if kind == "concurrency" and not memory_bound:
    wanted.discard("kv_quant")  # slots, not memory, are short
  actions = [key for key, _ in ACTIONS if key in wanted]
  return Diagnosis(kind, slow_ttft, slow_tpot, queue_bound, actions, reasons)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
  return "n/a" if value is None else format(value * scale, spec)


def format_report(signals: Signals, diagnosis: Diagnosis) -> str:
  """The seed's numbers, the kind of slow and the ordered actions, as printed lines."""
  p95_note = "exact" if signals.input_p95_exact else "bucket resolution"
  lines = [
      f"requests in window        {signals.num_requests:.0f}",
      f"input tokens mean / P95   {_fmt(signals.input_tokens_mean, '.1f')} / "
      f"{_fmt(signals.input_tokens_p95, '.1f')} ({p95_note})",
      f"KV cache utilization      {_fmt(signals.kv_utilization, '.1%')}",
      f"running / configured      {_fmt(signals.running, '.2f')} / "
      f"{_fmt(signals.max_num_seqs, '.0f')}",
      f"queue depth (mean)        {_fmt(signals.waiting, '.2f')}",
      f"TTFT mean                 {_fmt(signals.ttft_s, '.1f', 1e3)} ms",
      f"TPOT mean                 {_fmt(signals.tpot_s, '.2f', 1e3)} ms",
      f"queue time mean           {_fmt(signals.queue_time_s, '.1f', 1e3)} ms",
      f"prefix cache hit rate     {_fmt(signals.prefix_hit_rate, '.1%')}",
      f"preemptions               {_fmt(signals.num_preemptions, '.0f')}",
      f"diagnosis: {diagnosis.kind}" + (f" ({'; '.join(diagnosis.reasons)})"
                                        if diagnosis.reasons else ""),
  ]
  names = dict(ACTIONS)
  lines += [f"  {i}. {names[key]}" for i, key in enumerate(diagnosis.actions, 1)]
  return "\n".join(lines)


def sample_window(url: str, window_s: float, interval_s: float = 1.0) -> tuple:
  """Scrapes /metrics at the start, every interval_s, and at window_s -> (first, last, all)."""
  if not (window_s > 0 and interval_s > 0):
    raise ValueError(f"window and interval must be positive seconds, got window={window_s}, "
                     f"interval={interval_s}")
  start = time.monotonic()
  samples = [parse_metrics(scrape(url))]
  for k in range(1, math.ceil(window_s / interval_s) + 1):  # bounded: one per interval
    time.sleep(max(0.0, start + min(k * interval_s, window_s) - time.monotonic()))
    samples.append(parse_metrics(scrape(url)))
  return samples[0], samples[-1], samples
