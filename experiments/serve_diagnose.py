"""Serving diagnosis by symptom (C18) and long chat histories (C15) over HTTP, on the CPU.

Each load pattern gets its own local server (kvjax.server.serve_in_thread on
the default model, EOS off so every answer has its full length) and is sent
by kvjax.server.bench.client; kvjax.server.bench.diagnose then reads the run (client-side
lengths and latencies, the server's /metrics window and gauge samples) and
names the kind of slow:
  chat_no_cache  chats of N turns (the whole history each turn), one request
                 in flight, prefix cache off: the first token slows as the
                 history grows -> prefill
  chat_cache     the same chats, prefix cache on: only the new turn is
                 prefilled (C15: the last turn's TTFT cut) -> healthy
  small_pool     more requests in flight than the KV pool holds: they wait in
                 the queue for pages -> concurrency
Targets for "slow" are multiples of an unloaded baseline on the same server
(single-turn requests of one user message, one at a time).  All three
servers run at once: after warm-ups (compiles, not timings), `repeats` rounds
run the baseline and each pattern in turn, and each reports its median
round, so load from other processes on a shared machine hits all alike.
Prints the
claim ids, the seed's values and ours; writes results/<name>.json and .png
(TTFT per turn, and TTFT, TPOT and queue depth over time per pattern).
"""
import contextlib
import dataclasses
import functools
import logging
import math
from typing import Callable, Optional

from absl import app
from ml_collections import config_flags
import numpy as np

from experiments import common
import kvjax
from kvjax.engine.config import EngineConfig
from kvjax.server import serve_in_thread
from kvjax.server.bench import client as bench_client
from kvjax.server.bench import workloads as bench_workloads
from kvjax.server.bench import diagnose

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/serve_diagnose.py", "experiment config", lock_config=True)

EXPECTED = {"chat_no_cache": "prefill", "chat_cache": "healthy", "small_pool": "concurrency"}


def _chats(model, c, seed, num_turns=None) -> list:
  return bench_workloads.make_workload(
      "multi-turn-chat", vocab_size=model.config.vocab_size, num_requests=c.chat_num_chats,
      input_len=c.chat_user_len, output_len=c.chat_output_len,
      num_turns=num_turns or c.chat_num_turns, seed=seed)


def _pool_requests(model, c, seed) -> list:
  return bench_workloads.make_workload(
      "random", vocab_size=model.config.vocab_size, num_requests=c.pool_num_requests,
      input_len=c.pool_input_len, output_len=c.pool_output_len, seed=seed)


def _bench(server, model, sessions, c, *, rate, concurrency=None):
  return bench_client.run_benchmark(
      server.url, sessions, request_rate=rate, max_concurrency=concurrency,
      encode=functools.partial(model.tokenizer.encode, add_special_tokens=False),
      seed=c.seed, metrics_interval_s=c.metrics_interval_s)


def _curves(result):
  """Per request (start, TTFT, TPOT, turn) and the server's gauges over time, for the plot."""
  done = [r for r in result["requests"] if r["success"]]
  samples = result["server_metrics"]["samples"]
  return {"start_s": [r["start_s"] for r in done], "ttft_s": [r["ttft_s"] for r in done],
          "tpot_s": [r["tpot_s"] for r in done], "turn": [r["turn"] for r in done],
          "sample_t_s": [s["t"] for s in samples],
          "waiting": [s.get("num_requests_waiting", 0.0) for s in samples],
          "running": [s.get("num_requests_running", 0.0) for s in samples],
          "kv_usage": [s.get("kv_cache_usage_perc", 0.0) for s in samples]}


def _turn_ttft(result, num_turns):
  done = [r for r in result["requests"] if r["success"]]
  return [float(np.mean([r["ttft_s"] for r in done if r["turn"] == t])) for t in range(num_turns)]


@dataclasses.dataclass
class _Load:
  """One load pattern: its server's config and what to send (sessions(k): content k)."""

  engine_config: EngineConfig
  sessions: Callable[[int], list]
  rate: float
  concurrency: Optional[int]


def _loads(model, c) -> dict:
  # Room for answers whose text re-encodes longer (a split UTF-8 character -> U+FFFD).
  chat_len = min(model.config.max_position_embeddings,
                 c.chat_num_turns * (c.chat_user_len + 2 * c.chat_output_len))
  chat_config = dict(page_size=c.page_size, max_num_seqs=c.chat_num_chats,
                     max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=chat_len)
  pool_len = c.pool_input_len + c.pool_output_len
  pages_per_request = -(-pool_len // c.page_size)
  chats = functools.partial(_chats, model, c)
  return {
      "chat_no_cache": _Load(EngineConfig(**chat_config, prefix_cache=False), chats,
                             c.chat_request_rate, c.chat_max_concurrency),
      "chat_cache": _Load(EngineConfig(**chat_config, prefix_cache=True), chats,
                          c.chat_request_rate, c.chat_max_concurrency),
      "small_pool": _Load(
          EngineConfig(page_size=c.page_size, max_num_seqs=c.pool_max_num_seqs,
                       max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=pool_len,
                       num_pages=1 + c.pool_requests_held * pages_per_request),
          functools.partial(_pool_requests, model, c), c.pool_request_rate,
          c.pool_max_concurrency),
  }


def _measure(model, c) -> tuple:
  """Every pattern's server at once; warm-ups, then `repeats` interleaved rounds.

  Warm-up passes send other content (seeds 100+) on the measured arrival
  times, so measured runs meet (nearly) only row groups whose step programs
  are compiled.  Each round runs the baseline (single-turn requests one at a
  time on the no-cache chat server) and then every pattern with fresh content
  (seed + round: no prefix-cache hits across rounds), so load from other
  processes hits all of them alike.  -> (baseline summary, pattern -> result),
  the rounds with the median mean TTFT.
  """
  loads = _loads(model, c)
  baseline_sessions = _chats(model, c, c.seed + 200, num_turns=1)
  with contextlib.ExitStack() as stack:
    servers = {name: stack.enter_context(serve_in_thread(model, load.engine_config))
               for name, load in loads.items()}
    for name, load in loads.items():
      for k in range(c.warmup_passes):
        _bench(servers[name], model, load.sessions(c.seed + 100 + k), c, rate=load.rate,
               concurrency=load.concurrency)
    base_server = servers["chat_no_cache"]
    _bench(base_server, model, baseline_sessions, c, rate=math.inf, concurrency=1)
    rounds = {name: [] for name in ("baseline", *loads)}
    for r in range(c.repeats):
      rounds["baseline"].append(_bench(base_server, model, baseline_sessions, c, rate=math.inf,
                                       concurrency=1))
      for name, load in loads.items():
        rounds[name].append(_bench(servers[name], model, load.sessions(c.seed + r), c,
                                   rate=load.rate, concurrency=load.concurrency))
  median = {name: common.median_item(runs, key=lambda run: run["summary"]["ttft"]["mean"])
            for name, runs in rounds.items()}
  return median.pop("baseline")["summary"], median


def run_patterns(model, c):
  baseline, runs = _measure(model, c)
  targets = diagnose.Targets(ttft_s=c.ttft_factor * baseline["ttft"]["mean"],
                             tpot_s=c.tpot_factor * baseline["tpot"]["mean"])
  out = {"baseline": baseline, "targets": dataclasses.asdict(targets)}
  configured = {"chat_no_cache": c.chat_num_chats, "chat_cache": c.chat_num_chats,
                "small_pool": c.pool_max_num_seqs}
  for name, result in runs.items():
    signals = diagnose.signals_from_bench(result, configured[name])
    found = diagnose.diagnose(signals, targets)
    print(f"\n{name}: {result['summary']['completed']} requests")
    print(diagnose.format_report(signals, found))
    out[name] = {"summary": result["summary"], "signals": dataclasses.asdict(signals),
                 "diagnosis": dataclasses.asdict(found), "curves": _curves(result)}
    if name.startswith("chat"):
      out[name]["turn_ttft_s"] = _turn_ttft(result, c.chat_num_turns)
  return out


def _plot(results, path):
  names = list(EXPECTED)
  with common.figure(path, 1, 4, figsize=(20, 4)) as (_, axes):
    turns = np.arange(1, len(results["chat_cache"]["turn_ttft_s"]) + 1)
    for name in ("chat_no_cache", "chat_cache"):
      axes[0].plot(turns, np.asarray(results[name]["turn_ttft_s"]) * 1e3, "o-", label=name)
    axes[0].set(xlabel="turn", ylabel="mean TTFT (ms)", yscale="log",
                title=f"C15: last turn {results['last_turn_ttft_ratio']:.1f}x cut by the cache")
    for name in names:
      curves = results[name]["curves"]
      label = f"{name}: {results[name]['diagnosis']['kind']}"
      axes[1].plot(curves["start_s"], np.asarray(curves["ttft_s"]) * 1e3, ".", label=label)
      tpot = [(s, t) for s, t in zip(curves["start_s"], curves["tpot_s"]) if t is not None]
      axes[2].plot([s for s, _ in tpot], [t * 1e3 for _, t in tpot], ".", label=name)
      axes[3].plot(curves["sample_t_s"], curves["waiting"], label=name)
    targets = results["targets"]
    axes[1].axhline(targets["ttft_s"] * 1e3, color="gray", ls="--", label="TTFT target")
    axes[2].axhline(targets["tpot_s"] * 1e3, color="gray", ls="--", label="TPOT target")
    axes[1].set(xlabel="request start (s)", ylabel="TTFT (ms)", yscale="log",
                title="TTFT over time (diagnosis)")
    axes[2].set(xlabel="request start (s)", ylabel="TPOT (ms)", title="TPOT over time")
    axes[3].set(xlabel="time (s)", ylabel="waiting requests", title="queue depth (/metrics)")
    for ax in axes:
      ax.legend(fontsize=7)


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
  c = _CONFIG.value
  model = kvjax.load_checkpoint(c.checkpoint or None)
  # EOS off: every answer has its full length, so each turn's history grows alike.
  model = dataclasses.replace(model, config=model.config.replace(eos_token_id=None))
  device = common.describe_device()
  results = {"machine": f"{common.device_label(device)}, {device['os']}", "seed": c.seed,
             "model": model.config.name, "config": c.to_dict()}
  results.update(run_patterns(model, c))
  no_cache, cache = results["chat_no_cache"]["turn_ttft_s"], results["chat_cache"]["turn_ttft_s"]
  results["last_turn_ttft_ratio"] = no_cache[-1] / cache[-1]
  turns = len(no_cache)
  rows = [("C15", f"TTFT turn {turns} / turn 1, no prefix cache", "~10x",
           f"{no_cache[-1] / no_cache[0]:.1f}x"),
          ("C15/issue", f"turn-{turns} TTFT, no cache / cache", ">= 5x",
           f"{results['last_turn_ttft_ratio']:.1f}x")]
  rows += [("C18", f"diagnosis of {name}", expected, results[name]["diagnosis"]["kind"])
           for name, expected in EXPECTED.items()]
  results["table"] = common.claim_rows(rows)
  print(f"\nserve_diagnose on {results['machine']}, seed {c.seed}, model {model.config.name}")
  common.print_claims(results["table"], "{claim:<10} {what:<44} {seed:<12} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))


if __name__ == "__main__":
  app.run(main)
