"""kvjax.Router: data-parallel replicas, prefix-aware routing of multi-turn chats.

Oracle: one Engine serving every request (its outputs, token for token, and
its prefix hit rate); the prefix policy must keep each user's history on one
replica, so its hit rate is close to that single engine's and clearly above
round robin's, while every output stays the single engine's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from kvjax.engine.router import Router

USERS, TURNS, NEW_TOKENS = 16, 10, 6
ENGINE = dict(max_num_seqs=16, max_model_len=512, page_size=8, num_pages=1 + 16 * 40)


def _engines(model, n):
  return [kvjax.Engine(model, **ENGINE) for _ in range(n)]


def run_chats(target):
  """16 users x 10 turns; each turn's prompt is the whole conversation so far plus a new
  message, the users arriving in a shuffled order every turn -> (outputs, hit rate)."""
  rng = np.random.default_rng(0)
  system = rng.integers(3, 500, 24).tolist()
  history = {u: list(system) for u in range(USERS)}
  outputs = {}
  for turn in range(TURNS):
    ids = {}
    for u in rng.permutation(USERS).tolist():
      history[u] += rng.integers(3, 500, 10).tolist()  # the user's message
      ids[target.add_request(history[u], NEW_TOKENS)] = u
    while target.has_unfinished:
      for out in target.step():
        if out.finished:
          outputs[(ids[out.request_id], turn)] = out.output_ids
    for u in range(USERS):
      history[u] += outputs[(u, turn)]
  stats = target.stats()  # a Router's: totals over its replicas
  return outputs, stats.prefix_hit_tokens / stats.prefix_queried_tokens


@pytest.fixture(scope="module")
def single(tiny_model):
  return run_chats(kvjax.Engine(tiny_model, **ENGINE))


@pytest.mark.parametrize("replicas", [2, 4])
def test_prefix_routing_keeps_histories_together(tiny_model, single, replicas):
  want, single_rate = single
  router = Router(_engines(tiny_model, replicas), "prefix")
  got, prefix_rate = run_chats(router)
  assert got == want
  assert prefix_rate >= single_rate - 0.02, (prefix_rate, single_rate)
  # Balanced: each replica got its share of the users' 160 requests within the bound.
  share = USERS * TURNS / replicas
  assert max(router.routed) - min(router.routed) <= router.max_imbalance * TURNS, router.routed
  assert min(router.routed) > share / 2, router.routed
  if replicas == 2:
    rr_router = Router(_engines(tiny_model, replicas), "round_robin")
    rr_got, rr_rate = run_chats(rr_router)
    assert rr_got == want
    # Measured: single 0.815, prefix 0.815, round robin 0.705 (1.6x the misses).
    assert rr_rate < prefix_rate - 0.05 and 1 - rr_rate > 1.4 * (1 - prefix_rate), (
        rr_rate, prefix_rate)
    assert rr_router.routed == [USERS * TURNS // 2] * 2


def test_bad_router_arguments_are_named(tiny_model):
  engines = _engines(tiny_model, 1)
  with pytest.raises(ValueError, match="at least one engine"):
    Router([])
  with pytest.raises(ValueError, match="unknown routing policy 'random'"):
    Router(engines, "random")
  with pytest.raises(ValueError, match="max_imbalance must be an int >= 0, got -1"):
    Router(engines, max_imbalance=-1)


def test_abort_and_least_loaded(tiny_model):
  router = Router(_engines(tiny_model, 2), "least_loaded")
  first = router.add_request([5, 6, 7], 4)
  second = router.add_request([5, 6, 8], 4)
  assert (router.replica_of(first), router.replica_of(second)) == (0, 1)  # the idle one
  # What a server loop reads of an Engine, by the router's ids, over both replicas.
  assert router.config.max_num_seqs == 2 * ENGINE["max_num_seqs"]
  assert router.metrics[second].prompt_len == 3 and sorted(router.metrics) == [first, second]
  assert router.request(second).token_ids == [5, 6, 8] and router.request("nope") is None
  assert (router.stats().waiting, router.stats().running) == (2, 0)
  router.step()
  assert (router.stats().waiting, router.stats().running) == (0, 2)
  assert router.steps.batched_tokens == [6]  # one router step: 3 prompt tokens per replica
  assert router.stats().pages_used == 2  # one page each
  assert router.abort(first) and not router.abort("no-such-id")
  finals = {out.request_id: out for out in router.stream() if out.finished}
  assert finals[first].finish_reason == "abort"
  assert finals[second].finish_reason == "length" and len(finals[second].output_ids) == 4
  assert not router.has_unfinished
  with pytest.raises(KeyError, match="unknown or finished request"):
    router.replica_of(first)


def _replicas_summed(router) -> dict:
  """The oracle of Router.stats: each replica's scheduler and constraint book read
  directly, summed."""
  total = dict.fromkeys(("running", "waiting", "pages_used", "pages_usable", "num_preemptions",
                         "prefix_hit_tokens", "prefix_queried_tokens", "constrained",
                         "masks_filled", "mask_seconds"), 0)
  for engine in router.engines:
    scheduler, cache, book = engine.scheduler, engine.scheduler.prefix_cache, engine.constraints
    for name, number in (("running", len(scheduler.running)),
                         ("waiting", len(scheduler.waiting)),
                         ("pages_used", scheduler.allocator.num_used),
                         ("pages_usable", scheduler.allocator.num_usable),
                         ("num_preemptions", scheduler.num_preemptions),
                         ("prefix_hit_tokens", cache.hit_tokens),
                         ("prefix_queried_tokens", cache.queried_tokens),
                         ("constrained", len(book.matchers)),
                         ("masks_filled", book.masks_filled), ("mask_seconds", book.mask_s)):
      total[name] += number
  total["expert_tokens"] = None  # dense replicas: no expert counts
  return total


def test_stats_and_metrics_are_the_replicas_summed(tiny_model):
  """Router.stats() equals its replicas' schedulers summed at every step, and the
  server's /metrics (ServerMetrics.observe_engine of it) shows those numbers: 2 replicas
  of 7 usable pages (two 20-token prompts each: a preemption), every prompt sent twice
  (prefix hits)."""
  from prometheus_client.parser import text_string_to_metric_families

  from kvjax.server.prom import ServerMetrics

  router = Router([kvjax.Engine(tiny_model, **{**ENGINE, "num_pages": 1 + 7})
                   for _ in range(2)], "round_robin")
  metrics = ServerMetrics("m", max_model_len=ENGINE["max_model_len"],
                          max_num_seqs=router.config.max_num_seqs)
  metrics.observe_engine(router.stats())  # the baseline, as the server's first look
  prompts = [np.random.default_rng(i).integers(3, 500, 20).tolist() for i in range(4)]
  for _ in range(2):
    for prompt in prompts:
      router.add_request(prompt, 12)
    while router.has_unfinished:
      router.step()
      want = _replicas_summed(router)
      got = router.stats()
      assert dataclasses.asdict(got) == want
      metrics.observe_engine(got)
      text = metrics.exposition().decode()
      samples = {s.name: s.value for family in text_string_to_metric_families(text)
                 for s in family.samples}
      assert samples["kvjax:num_requests_running"] == want["running"]
      assert samples["kvjax:kv_cache_usage_perc"] == want["pages_used"] / want["pages_usable"]
      assert samples["kvjax:num_preemptions_total"] == want["num_preemptions"]
      assert samples["kvjax:prefix_cache_hits_total"] == want["prefix_hit_tokens"]
      assert samples["kvjax:prefix_cache_queries_total"] == want["prefix_queried_tokens"]
  assert want["num_preemptions"] > 0 and want["prefix_hit_tokens"] > 0, want
  assert router.routed == [4, 4]


def test_constrained_counts_are_the_replicas_books_summed():
  """Structured outputs through a Router: stats() carries its replicas' constraint books
  summed (requests under a grammar, masks filled, their seconds) and /metrics shows them:
  one JSON request per replica beside a plain one."""
  from prometheus_client.parser import text_string_to_metric_families

  from kvjax.constraints import Constraint
  from kvjax.constraints.vocabulary import constraint_book
  from kvjax.server.prom import ServerMetrics
  from tests.test_constraints import TOK, random_model

  model = random_model()
  engines = [kvjax.Engine(model, **ENGINE) for _ in range(2)]
  for engine in engines:
    engine.constraints = constraint_book(TOK, model.config)
  router = Router(engines, "round_robin")
  metrics = ServerMetrics("m", max_model_len=ENGINE["max_model_len"],
                          max_num_seqs=router.config.max_num_seqs)
  metrics.observe_engine(router.stats())
  for i in range(4):  # round robin: replica 0 gets requests 0 and 2, replica 1 gets 1 and 3
    router.add_request([3 + i, 40, 7], 10, constraint=Constraint("json_object") if i < 2 else None)
  seen_constrained = set()
  while router.has_unfinished:
    router.step()
    want, got = _replicas_summed(router), router.stats()
    assert dataclasses.asdict(got) == want
    metrics.observe_engine(got)
    samples = {s.name: s.value for family in text_string_to_metric_families(
        metrics.exposition().decode()) for s in family.samples}
    assert samples["kvjax:num_requests_constrained"] == want["constrained"]
    assert samples["kvjax:structured_masks_total"] == want["masks_filled"]
    assert samples["kvjax:structured_mask_seconds_total"] == pytest.approx(want["mask_seconds"])
    seen_constrained.add(want["constrained"])
  assert 2 in seen_constrained and want["constrained"] == 0
  assert want["masks_filled"] >= 2 and all(e.constraints.masks_filled for e in engines)


_CLI_DP = r"""
import argparse, json, sys
import jax
from kvjax.cli import main as cli
from kvjax.parallel import distributed
args = argparse.Namespace(tp=1, ep=1, dp=2, coordinator_address=None, num_processes=None,
                          process_id=None)
models = distributed.load_replicas(args, None, "float32")
print(json.dumps([sorted(d.id for d in jax.tree.leaves(m.params)[0].devices()) for m in models]))
sys.exit(cli.main(["generate", "--dp", "2", "--json", "--temperature", "0",
                   "--max-new-tokens", "4", "--prompt-ids", "1,2,3", "--no-warmup"]))
"""


def test_cli_generate_dp_samples_once_per_replica_on_its_own_device():
  """`generate --dp 2` on 2 (fake) devices: one replica each, greedy = single-device."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  run = subprocess.run([sys.executable, "-c", _CLI_DP], env=env, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  lines = run.stdout.splitlines()
  assert json.loads(lines[0]) == [[0], [1]]  # one device each
  samples = [json.loads(line) for line in lines[1:3]]
  want = kvjax.generate(kvjax.load_checkpoint(), [[1, 2, 3]], 4).tokens[0]
  assert [(s["replica"], s["tokens"]) for s in samples] == [(0, want), (1, want)]


def test_bench_workload_through_a_router_equals_one_engine(tiny_model):
  """`kvjax bench --dp` drives cli_bench.run_workload with a Router: the same outputs
  as one Engine, its summary counted over both replicas."""
  from kvjax.cli.bench import run_workload
  from kvjax.server.bench.workloads import make_workload

  sessions = make_workload("multi-turn-chat", vocab_size=tiny_model.config.vocab_size,
                           num_requests=4, input_len=20, output_len=4, num_turns=2, seed=0)
  single = run_workload(kvjax.Engine(tiny_model, **ENGINE), sessions)
  router = Router(_engines(tiny_model, 2), "prefix")
  routed = run_workload(router, sessions)
  assert routed["outputs"] == single["outputs"]
  assert routed["num_requests"] == 8 and min(router.routed) > 0
  assert routed["prefix_hit_rate"] > 0  # turn 2 found turn 1's blocks on its replica
