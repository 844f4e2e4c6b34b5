"""Serving behind smg (issue 32): a multi-turn workload's throughput through
`smg launch --policy cache_aware` over 2 `python -m kvjax serve` workers vs 1 worker
asked directly (goal: >= 1.8x).

Each setup runs `conversations` conversations at once (one client thread each), every
turn's prompt the previous prompt + its answer + a new line, greedy; throughput is
generated tokens / wall seconds, median of interleaved rounds (common.interleaved), each
round with new conversation texts (no prefix carried over from a previous round).  The
workers share one --compile-cache directory.  On a CPU host the 2 workers share its
cores: the ratio is bounded by them; the cores and the load average are recorded.
Prints the issue's claim, the goal and ours; writes results/<name>.json and .png.
"""
import concurrent.futures
import itertools
import logging
import os
import tempfile

from absl import app
from ml_collections import config_flags
import httpx

from experiments import common
from tests.gateway_servers import Gateway, ServeProcess


def workload(c, root: str, model: str, tag: str) -> int:
  """The conversations against `root`; returns the tokens generated."""
  def conversation(i: int) -> int:
    prompt, generated = f"# {tag} conversation {i}: a queue class\n", 0
    for turn in range(c.turns):
      answer = httpx.post(root + "/v1/completions", timeout=300, json={
          "model": model, "prompt": prompt, "max_tokens": c.max_tokens, "temperature": 0})
      answer.raise_for_status()
      body = answer.json()
      generated += body["usage"]["completion_tokens"]
      prompt += body["choices"][0]["text"] + f"\n# turn {turn}\n"
    return generated
  with concurrent.futures.ThreadPoolExecutor(c.conversations) as pool:
    return sum(pool.map(conversation, range(c.conversations)))


def plot(results: dict, path: str) -> None:
  with common.figure(path, figsize=(5, 3.5)) as (_, ax):
    names = list(results["tokens_per_s"])
    ax.bar(names, [results["tokens_per_s"][n] for n in names])
    ax.set_ylabel("generated tokens / s (median)")
    ax.set_title(f"multi-turn throughput, {results['cores']} cores, "
                 f"load {results['load_before'][0]:.1f}")


def run(c) -> dict:
  results = {"device": common.device_label(), "cores": os.cpu_count(),
             "load_before": os.getloadavg(), "config": c.to_dict()}
  rounds = itertools.count()
  with tempfile.TemporaryDirectory() as tmp:
    args = [*c.serve_args, "--compile-cache", os.path.join(tmp, "xla")]
    workers = [ServeProcess(args)]
    try:
      workers.append(ServeProcess(args))
      gateway = Gateway(workers, os.path.join(tmp, "smg.log"), policy="cache_aware",
                        timeout_s=120)
      model = workers[0].model
      try:
        runs = {"1 worker direct": lambda: workload(c, workers[0].root, model, next(rounds)),
                "smg cache_aware, 2 workers": lambda: workload(c, gateway.root, model,
                                                               next(rounds))}
        timings = common.interleaved(runs, c.repeats)
      finally:
        gateway.stop()
    finally:
      for w in workers:
        w.stop()
  results["load_after"] = os.getloadavg()
  results["seconds"] = timings.seconds
  results["tokens"] = timings.results
  results["tokens_per_s"] = {name: common.median([t / s for t, s in zip(
      timings.results[name], timings.seconds[name])]) for name in runs}
  direct, gated = results["tokens_per_s"].values()
  results["ratio"] = gated / direct
  results["table"] = [{
      "claim": "#32", "what": f"multi-turn throughput ({c.conversations} conversations x "
                              f"{c.turns} turns), smg cache_aware over 2 workers / 1 worker",
      "seed": f"goal >= {c.goal_ratio}x",
      "ours": f"{results['ratio']:.2f}x ({gated:.1f} vs {direct:.1f} tok/s; "
              f"{results['cores']} cores, load {results['load_before'][0]:.1f}->"
              f"{results['load_after'][0]:.1f})"}]
  print(f"gateway_bench on {results['device']}")
  common.print_claims(results["table"], "{claim:<5} {what:<95} {seed:<14} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=lambda p: plot(results, p))
  return results


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: tests import launchers side by side, and absl allows
  # one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/gateway_bench.py", "experiment config", lock_config=True)
  app.run(main)
