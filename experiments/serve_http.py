"""HTTP serving overhead and a request-rate sweep (issue 13; C18's numbers per rate).

One local server (kvjax.server.serve_in_thread, the default model, EOS off so
every answer has its full length) gets the same random workload
(kvjax/cli/bench.py, `input_len` -> `output_len` tokens) from the bench client
(kvjax/server/bench/client.py, streamed completions) at each request rate (Poisson
arrivals) and at saturation (every request at once).  The same requests also
run offline through a warm Engine with the same options; at saturation
`repeats` interleaved rounds of (HTTP, offline) give the overhead ratio
HTTP output tokens/s / offline output tokens/s (goal >= 0.9), so load from
other processes on a shared machine hits both alike.

What it measures is a warm server seen by a client in another process:
  * the bench client runs in a child process, as a real client does; beside
    the server's threads its event loop shared the GIL with uvicorn and the
    engine thread and slowed the server it timed.  (It still shares the cores.)
  * the timed rounds compile nothing.  Arrival order decides which row
    buckets a step packs (how many requests came before the first step,
    where chunked prefills split), so without a warm-up new (rows, chunk,
    table width) shapes keep turning up for many rounds, each an XLA
    compilation of seconds.  The server warms up in full (serve_in_thread
    warm_up="full": Engine.warm_up compiles every step program its shapes
    allow before it listens; the JSON has how many and how long), which also
    covers the offline engine (same shapes, one jit cache per process; its
    own warm-up then only settles its fresh state, kvjax/engine/warm_up.py).  A
    round (or sweep point) that still compiled a step program
    (kvjax.runtime.serve_steps.num_compiled) is run again, at most `max_tries` times;
    the JSON counts them.  A fresh server's first saturated round is reported
    apart, with the programs compiled after the warm-up (0 expected).
Prints the claim ids, the seed's values and ours; writes results/<name>.json and .png.
"""
import concurrent.futures
import functools
import math
import multiprocessing

from absl import app
from ml_collections import config_flags

from experiments import common
import kvjax
from kvjax.cli import bench as cli_bench
from kvjax.engine.config import EngineConfig
from kvjax.engine.engine import Engine
from kvjax.runtime import serve_steps
from kvjax.server import serve_in_thread
from kvjax.server.bench import client as bench_client
from kvjax.server.bench import workloads as bench_workloads

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/serve_http.py", "experiment config", lock_config=True)


def _offline(engine, sessions) -> dict:
  for cache in engine.prefix_caches():  # a repeat must not hit the run before
    cache.reset()
  return cli_bench.run_workload(engine, sessions)


def _http(client, url, sessions, rate, goodput) -> dict:
  """One bench run from the client process `client` (a one-worker process pool)."""
  return client.submit(bench_client.run_benchmark, url, sessions, request_rate=rate,
                       goodput=goodput, metrics_interval_s=None).result()["summary"]


def _without_compiles(fn, max_tries: int, tally: dict):
  """fn() until a call compiles no step program (at most max_tries calls) -> its result;
  tally["retried"] counts the calls that compiled, tally["compiled_kept"] the kept
  call's programs (0 unless max_tries ran out)."""
  for tries in range(1, max_tries + 1):
    before = serve_steps.num_compiled()
    result = fn()
    compiled = serve_steps.num_compiled() - before
    if not compiled or tries == max_tries:
      break
  tally["retried"] += tries - 1
  tally["compiled_kept"] += compiled
  return result


def main(argv):
  del argv
  c = _CONFIG.value
  model = kvjax.load_checkpoint(c.checkpoint or None)
  model = kvjax.Model(model.config.replace(eos_token_id=None), model.params, model.dtype,
                      model.tokenizer)
  sessions = bench_workloads.make_workload(
      "random", vocab_size=model.config.vocab_size, num_requests=c.num_prompts,
      input_len=c.input_len, output_len=c.output_len, seed=c.seed)
  config = EngineConfig(max_num_seqs=c.max_num_seqs,
                        max_num_batched_tokens=c.max_num_batched_tokens,
                        max_model_len=c.input_len + c.output_len + 1)
  goodput = {"ttft": c.goodput_ttft_ms, "tpot": c.goodput_tpot_ms}
  engine = Engine(model, config)
  tally = {"retried": 0, "compiled_kept": 0}
  steady = functools.partial(_without_compiles, max_tries=c.max_tries, tally=tally)
  spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of our threads
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as client, \
      serve_in_thread(model, config, warm_up="full") as server:
    http = functools.partial(_http, client, server.url, sessions)
    saturated = {"http": functools.partial(http, math.inf, goodput),
                 "offline": functools.partial(_offline, engine, sessions)}
    engine.warm_up()  # its programs are the server's; this settles its fresh state
    warmed = serve_steps.num_compiled()  # both engines warmed up
    cold = saturated["http"]()  # a fresh server's first burst of traffic: compiles nothing now
    cold_compiled = serve_steps.num_compiled() - warmed
    for _ in range(c.warmup):  # untimed, compiles expected
      for fn in saturated.values():
        fn()
    runs = common.interleaved({name: functools.partial(steady, fn)
                               for name, fn in saturated.items()}, c.repeats, warmup=0)
    best = runs.median_results(key=lambda r: -r.get("output_throughput", r.get("tokens_per_s")))
    sweep = {str(rate): steady(functools.partial(http, rate, goodput))
             for rate in c.request_rates}
    compiled_after_warm_up = serve_steps.num_compiled() - warmed
  http, offline = best["http"], best["offline"]
  sweep["inf"] = http
  ratio = http["output_throughput"] / offline["tokens_per_s"]
  device = common.describe_device()
  results = {"machine": f"{common.device_label(device)}, {device['os']}", "seed": c.seed,
             "model": model.config.name, "config": c.to_dict(), "client": "child process",
             "offline_tokens_per_s": offline["tokens_per_s"],
             "http_tokens_per_s_at_saturation": http["output_throughput"],
             "overhead_ratio": ratio,
             "rounds_tokens_per_s": {  # every timed round, in order: pairs ran side by side
                 "http": [r["output_throughput"] for r in runs.results["http"]],
                 "offline": [r["tokens_per_s"] for r in runs.results["offline"]]},
             "offline_ttft_mean_s": offline["ttft_s"],
             "server_warm_up": {"mode": "full", "programs_compiled": server.warm_up.programs,
                                "programs_run": server.warm_up.runs,
                                "seconds": server.warm_up.seconds},
             "cold_server_first_round": cold, "cold_round_programs_compiled": cold_compiled,
             # by both engines (they share the jit cache), which the server's warm-up left out
             "programs_compiled_after_server_warm_up": compiled_after_warm_up,
             "rounds_rerun_for_compiles": tally["retried"],
             "programs_compiled_in_kept_rounds": tally["compiled_kept"], "sweep": sweep}
  rows = [("issue", "HTTP / offline output tok/s at saturation", ">= 0.9", f"{ratio:.2f}x"),
          ("issue", "offline Engine at saturation: tok/s, TTFT mean ms", "-",
           f"{offline['tokens_per_s']:.0f}, {offline['ttft_s'] * 1e3:.0f}"),
          ("issue", "server warm-up (full): step programs compiled, seconds", "-",
           f"{server.warm_up.programs}, {server.warm_up.seconds:.0f}"),
          ("issue", "new server, first round at inf: tok/s, TTFT ms, compiles", "-",
           f"{cold['output_throughput']:.0f}, {cold['ttft']['mean'] * 1e3:.0f}, {cold_compiled}")]
  for rate, s in sweep.items():
    rows.append(("C18", f"rate {rate}/s: tok/s, goodput req/s, TTFT / TPOT mean ms", "-",
                 f"{s['output_throughput']:.0f}, {s['goodput']:.2f}, "
                 f"{s['ttft']['mean'] * 1e3:.0f} / {s['tpot']['mean'] * 1e3:.1f}"))
  results["table"] = common.claim_rows(rows)
  print(f"serve_http on {results['machine']}, model {model.config.name}; "
        f"{tally['retried']} runs rerun after compiling")
  common.print_claims(results["table"], "{claim:<6} {what:<58} {seed:<8} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))


def _plot(results, path):
  sweep = results["sweep"]
  labels = list(sweep)
  with common.figure(path, 1, 2, figsize=(11, 4)) as (_, axes):
    axes[0].bar(labels, [sweep[r]["output_throughput"] for r in labels], label="HTTP")
    axes[0].axhline(results["offline_tokens_per_s"], color="k", ls="--", label="offline Engine")
    axes[0].set(xlabel="request rate (req/s)", ylabel="output tokens/s",
                title=f"throughput (overhead ratio {results['overhead_ratio']:.2f}x)")
    axes[0].legend()
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
      axes[1].plot(labels, [sweep[r][key]["mean"] * 1e3 for r in labels], "o-", label=f"{label} mean")
      axes[1].plot(labels, [sweep[r][key]["p99"] * 1e3 for r in labels], "x--", label=f"{label} p99")
    axes[1].set(xlabel="request rate (req/s)", ylabel="ms", yscale="log", title="latency")
    axes[1].legend()


if __name__ == "__main__":
  app.run(main)
