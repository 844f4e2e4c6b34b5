"""kvjax serve workers behind the Shepherd Model Gateway (smg, docs/DEPLOY.md).

Two `python -m kvjax serve` processes and `smg launch --policy cache_aware` on loopback
ephemeral ports.  Oracles: each worker's own answers (greedy, asked directly), smg's
/workers list, the prefix-cache counters each worker reports on /metrics, and the HTTP
status of every request after one worker is killed.
smg comes with the test extra (`pip install smg==1.13.0`); without it these tests fail
saying so."""
from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from tests.gateway_servers import TINY, Gateway, ServeProcess

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):", "# sort a list\ndef sort(xs):", "x = [1, 2, 3]\n"]
_MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  assert shutil.which("smg"), "smg is not installed: pip install smg==1.13.0 (the test extra)"
  workers = [ServeProcess([*TINY, "--warm-up", "minimal"]) for _ in range(2)]
  try:
    gateway = Gateway(workers, tmp_path_factory.mktemp("smg") / "smg.log")
  except BaseException:
    for w in workers:
      w.stop()
    raise
  yield workers, gateway
  gateway.stop()
  for w in workers:
    w.stop()


def _text(root: str, model: str, prompt: str) -> str:
  answer = httpx.post(root + "/v1/completions", timeout=60, json={
      "model": model, "prompt": prompt, "max_tokens": _MAX_TOKENS, "temperature": 0})
  assert answer.status_code == 200, answer.text
  return answer.json()["choices"][0]["text"]


def test_greedy_outputs_through_smg_equal_direct_ones(cluster):
  workers, gateway = cluster
  model = workers[0].model
  direct = [_text(workers[0].root, model, p) for p in PROMPTS]
  assert [_text(workers[1].root, model, p) for p in PROMPTS] == direct  # same weights
  assert [_text(gateway.root, model, p) for p in PROMPTS] == direct
  chat = {"model": model, "messages": [{"role": "user", "content": "def f(x):"}],
          "max_tokens": _MAX_TOKENS, "temperature": 0}
  answers = [httpx.post(root + "/v1/chat/completions", json=chat, timeout=60).json()
             for root in (workers[0].root, gateway.root)]
  assert answers[1]["choices"][0]["message"] == answers[0]["choices"][0]["message"]
  # Both workers served some of it (cache_aware balances distinct prefixes).
  served = [httpx.get(w.root + "/metrics", timeout=10).text for w in workers]
  assert all('kvjax:request_success_total{finished_reason="length"' in s for s in served)


def test_smg_reads_the_workers_metadata(cluster):
  workers, gateway = cluster
  for w in workers:
    info = httpx.get(w.root + "/server_info", timeout=10).json()
    assert info["served_model_name"] == w.model and info["context_length"] == 64
    assert httpx.get(w.root + "/get_model_info", timeout=10).json()["is_generation"]
  log = open(gateway.log_path).read()
  assert "returned 404" not in log  # /server_info and /model_info answered


def _prefix_counters(workers) -> tuple[float, float]:
  """(hit, queried) prompt tokens summed over the workers' /metrics."""
  totals = {"hits": 0.0, "queries": 0.0}
  for w in workers:
    for line in httpx.get(w.root + "/metrics", timeout=10).text.splitlines():
      match = re.match(r"kvjax:prefix_cache_(hits|queries)_total(?:\{.*\})? (\S+)$", line)
      if match:
        totals[match.group(1)] += float(match.group(2))
  return totals["hits"], totals["queries"]


def _multi_turn_hit_rate(workers, gateway, tag: str) -> float:
  """Prefix-cache hit rate over the workers of 3 conversations of 3 turns each, one
  conversation after the other, every turn's prompt the previous prompt + its answer + a
  new line (`tag` keeps each run's prompts out of the other run's cache)."""
  model = workers[0].model
  hits0, queries0 = _prefix_counters(workers)
  for conversation in range(3):
    prompt = f"# {tag} {conversation}: a stack class\n"
    for turn in range(3):
      answer = httpx.post(gateway.root + "/v1/completions", timeout=60, json={
          "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
      assert answer.status_code == 200, answer.text
      prompt += answer.json()["choices"][0]["text"] + f"\n#{turn}\n"
  time.sleep(0.5)  # the counters follow the engine's step after the last answer
  hits1, queries1 = _prefix_counters(workers)
  assert queries1 > queries0
  return (hits1 - hits0) / (queries1 - queries0)


def test_cache_aware_hits_the_prefix_cache_at_least_as_often_as_round_robin(
    cluster, tmp_path):
  workers, cache_aware = cluster
  round_robin = Gateway(workers, tmp_path / "smg-rr.log", policy="round_robin")
  try:
    rates = {"round_robin": _multi_turn_hit_rate(workers, round_robin, "rr"),
             "cache_aware": _multi_turn_hit_rate(workers, cache_aware, "ca")}
  finally:
    round_robin.stop()
  print(f"multi-turn prefix-cache hit rate over 2 workers: {rates}")
  assert rates["cache_aware"] >= rates["round_robin"], rates
  assert rates["cache_aware"] > 0, rates  # turns 2 and 3 find their conversation's blocks


def test_killing_a_worker_leaves_every_later_request_served(cluster):
  workers, gateway = cluster
  model = workers[0].model
  direct = {p: _text(workers[0].root, model, p) for p in PROMPTS}
  workers[1].proc.kill()
  workers[1].proc.wait(10)
  statuses, texts = [], {}
  start = time.monotonic()
  for prompt in PROMPTS * 3:
    answer = httpx.post(gateway.root + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": _MAX_TOKENS, "temperature": 0})
    statuses.append(answer.status_code)
    if answer.status_code == 200:
      texts[prompt] = answer.json()["choices"][0]["text"]
  assert statuses == [200] * len(statuses), open(gateway.log_path).read()[-3000:]
  assert texts == direct
  assert time.monotonic() - start < 60
