"""The server's Prometheus metrics: vLLM's names under `kvjax:`, one registry per server.

With `vllm_names` (serve --vllm-metrics) /metrics also carries every one of them under
`vllm:` (the same values: one collector renames the registry's families at each scrape),
for routers and dashboards that read vLLM's names (llm-d's scheduler reads
vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc).  Opt-in:
it doubles the series, and a fleet dashboard summing vllm: series would count kvjax
servers as vLLM ones.  kvjax:max_num_seqs, not a vLLM metric, keeps its one name.

Gauges follow the engine's stats (kvjax/engine/stats.py, a Router's summed over its
replicas) after every engine step and admission; counters of its cumulative totals
(prefix cache, preemptions) advance by their deltas; token counters advance as
tokens reach clients (a stop string's completion ends at the token that
completed it); request histograms and request_success come
from kvjax/engine/metrics.py's RequestMetrics of each finished request.  Every
series carries a model_name label, as vLLM's do.  `kvjax:max_num_seqs` is the
configured concurrency (what C18's diagnosis compares running requests with).
An MoE model's expert load (kvjax-only names, built at each scrape from the engine's
cumulative [L, Ne] counts since the first look): kvjax:moe_expert_tokens_total{layer,
expert}, the tokens a layer routed to an expert, and kvjax:moe_expert_load_imbalance
{layer}, the most any expert got over the mean (1: even; Ne / Ke: every token chose the
same Ke experts); only layers that routed a token appear.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvjax.engine.metrics import RequestMetrics
from kvjax.engine.stats import EngineStats

__all__ = ["ServerMetrics"]

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _one_two_five(maximum: int) -> list[int]:
  """1, 2, 5, 10, 20, 50, ... up to maximum (vLLM's token-count buckets)."""
  out, scale = [], 1
  while True:
    for step in (1, 2, 5):
      if step * scale > maximum:
        return out
      out.append(step * scale)
    scale *= 10


# No vLLM metric of these names: no vllm: view of them.
_KVJAX_ONLY = ("max_num_seqs", "moe_expert_tokens", "moe_expert_load_imbalance")


class _ExpertLoad:
  """A collector: the expert load families (module doc) from the counts last observed,
  less the first ones observed (the baseline, as observe_engine's counters)."""

  def __init__(self, model_name: str):
    self._model_name, self._first, self._now = model_name, None, None

  def observe(self, counts: np.ndarray) -> None:
    if self._first is None:
      self._first = counts
    self._now = counts

  def collect(self):
    if self._now is None:
      return
    since = self._now - self._first  # [L, Ne]
    tokens = CounterMetricFamily("kvjax:moe_expert_tokens",
                                 "Tokens a layer routed to an expert (MoE models).",
                                 labels=["model_name", "layer", "expert"])
    imbalance = GaugeMetricFamily("kvjax:moe_expert_load_imbalance",
                                  "Most tokens any expert of a layer got over the mean.",
                                  labels=["model_name", "layer"])
    for layer in np.flatnonzero(since.sum(1)):
      for expert, count in enumerate(since[layer]):
        tokens.add_metric([self._model_name, str(layer), str(expert)], float(count))
      imbalance.add_metric([self._model_name, str(layer)],
                           float(since[layer].max() / since[layer].mean()))
    yield tokens
    yield imbalance


class _Renamed:
  """A collector: the families of `source` named `old` + x (x not in `skip`), as `new` + x."""

  def __init__(self, source: prom.CollectorRegistry, old: str, new: str, skip=()):
    self._source, self._old, self._new, self._skip = source, old, new, skip

  def collect(self):
    for family in self._source.collect():
      base = family.name[len(self._old):]
      if not family.name.startswith(self._old) or base in self._skip:
        continue
      renamed = prom.Metric(self._new + base, family.documentation, family.type, family.unit)
      renamed.samples = [s._replace(name=self._new + s.name[len(self._old):])
                         for s in family.samples]
      yield renamed


class ServerMetrics:
  """Every metric of one server, in its own registry (`exposition()` renders it, with
  their vllm: view after them when `vllm_names`)."""

  def __init__(self, model_name: str, *, max_model_len: int, max_num_seqs: int,
               vllm_names: bool = False):
    self.registry = prom.CollectorRegistry(auto_describe=True)
    self._vllm_view = None
    if vllm_names:
      self._vllm_view = prom.CollectorRegistry()
      self._vllm_view.register(_Renamed(self.registry, "kvjax:", "vllm:", _KVJAX_ONLY))
    labels = {"model_name": model_name}

    def make(kind, name, text, extra=(), **options):
      metric = kind("kvjax:" + name, text, ["model_name", *extra], registry=self.registry,
                    **options)
      return metric if extra else metric.labels(**labels)

    self._labels = labels
    self.running = make(prom.Gauge, "num_requests_running", "Requests holding a slot.")
    self.waiting = make(prom.Gauge, "num_requests_waiting", "Requests admitted, not running.")
    self.kv_usage = make(prom.Gauge, "kv_cache_usage_perc",
                         "Fraction of KV pages held by requests (1 = full).")
    make(prom.Gauge, "max_num_seqs", "Configured concurrency (running requests at most)."
         ).set(max_num_seqs)
    self.prefix_queries = make(prom.Counter, "prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache.")
    self.prefix_hits = make(prom.Counter, "prefix_cache_hits",
                            "Prompt tokens found in the prefix cache.")
    self.preemptions = make(prom.Counter, "num_preemptions", "Requests preempted.")
    self.prompt_tokens = make(prom.Counter, "prompt_tokens", "Prefilled prompt tokens.")
    self.generation_tokens = make(prom.Counter, "generation_tokens", "Generated tokens.")
    self.success = make(prom.Counter, "request_success", "Finished requests.",
                        ["finished_reason"])
    self.draft_tokens = make(prom.Counter, "spec_decode_num_draft_tokens", "Draft tokens.")
    self.accepted_tokens = make(prom.Counter, "spec_decode_num_accepted_tokens",
                                "Accepted draft tokens.")
    self.accepted_per_pos = make(prom.Counter, "spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted draft tokens per draft position.", ["position"])
    self.ttft = make(prom.Histogram, "time_to_first_token_seconds", "Time to first token.",
                     buckets=_TTFT_BUCKETS)
    self.itl = make(prom.Histogram, "inter_token_latency_seconds", "Inter-token latency.",
                    buckets=_TOKEN_GAP_BUCKETS)
    self.tpot = make(prom.Histogram, "time_per_output_token_seconds",
                     "Mean time per output token after the first.", buckets=_TOKEN_GAP_BUCKETS)
    self.e2e = make(prom.Histogram, "e2e_request_latency_seconds", "End-to-end latency.",
                    buckets=_REQUEST_BUCKETS)
    self.queue_time = make(prom.Histogram, "request_queue_time_seconds",
                           "Arrival to first scheduled.", buckets=_REQUEST_BUCKETS)
    token_buckets = _one_two_five(max_model_len)
    self.request_prompt = make(prom.Histogram, "request_prompt_tokens",
                               "Prompt tokens per request.", buckets=token_buckets)
    self.request_generation = make(prom.Histogram, "request_generation_tokens",
                                   "Generated tokens per request.", buckets=token_buckets)
    self.constrained = make(prom.Gauge, "num_requests_constrained",
                            "Unfinished requests under a grammar (structured outputs).")
    self.mask_seconds = make(prom.Counter, "structured_mask_seconds",
                             "Host seconds spent filling grammar token masks.")
    self.masks = make(prom.Counter, "structured_masks",
                      "Grammar token masks filled (one per row and verified position).")
    self._totals = None  # the engine's cumulative counters last seen (observe_engine)
    self._expert_load = _ExpertLoad(model_name)
    self.registry.register(self._expert_load)

  def observe_engine(self, stats: EngineStats) -> None:
    """Gauges from the engine's stats now; counters by their totals' growth since last time.

    (The waiting gauge is a function its owner sets: it counts requests not yet handed
    to the engine too.)
    """
    self.running.set(stats.running)
    self.kv_usage.set(stats.utilization)
    self.constrained.set(stats.constrained)
    counters = (self.prefix_queries, self.prefix_hits, self.preemptions, self.masks,
                self.mask_seconds)
    totals = (stats.prefix_queried_tokens, stats.prefix_hit_tokens, stats.num_preemptions,
              stats.masks_filled, stats.mask_seconds)
    if self._totals is not None:  # the first look (after warm-up) is the baseline
      for counter, now, before in zip(counters, totals, self._totals):
        counter.inc(now - before)
    self._totals = totals
    if stats.expert_tokens is not None:
      self._expert_load.observe(stats.expert_tokens)

  def record_finished(self, metrics: RequestMetrics, finish_reason: str,
                      num_generated: int, queue_s: Optional[float]) -> None:
    """A finished request: its outcome and its RequestMetrics' latencies."""
    self.success.labels(**self._labels, finished_reason=finish_reason).inc()
    self.request_prompt.observe(metrics.prompt_len)
    self.request_generation.observe(num_generated)
    if queue_s is not None:
      self.queue_time.observe(queue_s)
    if metrics.ttft_s is not None:
      self.ttft.observe(metrics.ttft_s)
      self.e2e.observe(metrics.e2e_s)
    if metrics.tpot_s is not None:
      self.tpot.observe(metrics.tpot_s)
    for gap in metrics.itls_s:
      self.itl.observe(gap)
    for position, accepted in enumerate(metrics.accepted):
      self.accepted_per_pos.labels(**self._labels, position=str(position)).inc(accepted)
    self.draft_tokens.inc(sum(metrics.proposed))
    self.accepted_tokens.inc(sum(metrics.accepted))

  def exposition(self) -> bytes:
    """The Prometheus text format of every metric (and of its vllm: view, if on)."""
    text = prom.generate_latest(self.registry)
    return text if self._vllm_view is None else text + prom.generate_latest(self._vllm_view)
