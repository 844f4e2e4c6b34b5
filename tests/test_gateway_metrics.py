"""--vllm-metrics: /metrics also under vLLM's names, with the kvjax: series' values.

Oracles: the requests' own usage (completion tokens), their count and finish reasons,
the pages a shared prompt prefix fills (prefix cache hits), and prometheus_client's
parser (tests/server_helpers.scrape)."""
from __future__ import annotations

import httpx
import pytest

import kvjax
from kvjax.server import serve_in_thread
from tests.server_helpers import scrape, value

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, page_size=16)
# Routers read these by name (llm-d: the first three; prefix hit rates: the counters).
VLLM_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
              "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
              "vllm:prompt_tokens_total", "vllm:num_preemptions_total")


@pytest.fixture(scope="module")
def served(tiny_model):
  """A --vllm-metrics server after two requests whose prompts share 2 pages (32 ids)."""
  with serve_in_thread(tiny_model, kvjax.EngineConfig(**SMALL), vllm_metrics=True) as server:
    shared = list(range(10, 42))
    usage = [httpx.post(server.url + "/completions", timeout=60, json={
        "model": server.model_name, "prompt": shared + [50 + i], "max_tokens": 5}
    ).json()["usage"] for i in range(2)]
    yield scrape(server.root), usage


def test_vllm_names_carry_the_kvjax_values(served):
  samples, usage = served
  names = {n for n, _ in samples}
  for name in VLLM_NAMES:
    assert name in names
    assert value(samples, name) == value(samples, "kvjax:" + name[5:]), name
  assert value(samples, "vllm:generation_tokens_total") == sum(u["completion_tokens"]
                                                               for u in usage)
  assert value(samples, "vllm:prompt_tokens_total") == 2 * 33
  assert value(samples, "vllm:prefix_cache_queries_total") == 2 * 33
  assert value(samples, "vllm:prefix_cache_hits_total") == 32  # the second one's 2 pages
  assert value(samples, "vllm:num_requests_running") == 0
  finished = sum(v for (n, labels), v in samples.items()
                 if n == "vllm:request_success_total")
  assert finished == 2
  assert value(samples, "vllm:e2e_request_latency_seconds_count") == 2
  assert "vllm:max_num_seqs" not in names  # not a vLLM metric


def test_without_the_flag_there_is_no_vllm_name(tiny_model):
  with serve_in_thread(tiny_model, kvjax.EngineConfig(**SMALL)) as server:
    text = httpx.get(server.root + "/metrics", timeout=10).text
  assert "kvjax:num_requests_waiting" in text and "vllm:" not in text
