"""Serving behind smg (issue 32): a multi-turn workload's throughput through
`smg launch --policy cache_aware` over 2 `python -m kvjax serve` workers vs 1 worker
asked directly (goal: >= 1.8x).

Each setup runs `conversations` conversations at once (one client thread each), every
turn's prompt the previous prompt + its answer + a new line, greedy; throughput is
generated tokens / wall seconds, median of interleaved rounds (common.interleaved), each
round with new conversation texts (no prefix carried over from a previous round).  The
workers share one --compile-cache directory.  Two placements, timed side by side: the
workers sharing every core (on a 2-core host the ratio is bounded by the cores, not by
smg), and each worker on a core of its own (one device group per worker, what a deployment
gives each worker; the 1-worker baseline then has one core too).  The cores and the load
average are recorded.
Prints the issue's claim, the goal and ours; writes results/<name>.json and .png.
"""
import concurrent.futures
import contextlib
import itertools
import logging
import os
import random
import tempfile

from absl import app
from ml_collections import config_flags
import httpx

from experiments import common
from tests.gateway_servers import Gateway, ServeProcess


def _stat(pid) -> list:
  """/proc/<pid>/stat's fields after the command name (field 3 on)."""
  with open(f"/proc/{pid}/stat") as stat:
    return stat.read().rsplit(")", 1)[1].split()


def cpu_seconds(pids) -> dict:
  """CPU seconds so far (user + system, every thread) of each named process and the
  processes it started that are not named too (smg's launcher starts the router as a
  child)."""
  tick = os.sysconf("SC_CLK_TCK")
  parents = {}
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        parents[int(entry)] = int(_stat(entry)[1])
      except (OSError, IndexError):
        continue  # ended meanwhile
  out = {}
  for name, pid in pids.items():
    tree, grown = {pid}, True
    while grown:  # children not named themselves (the client started the others)
      more = {p for p, parent in parents.items() if parent in tree} - tree - set(pids.values())
      tree, grown = tree | more, bool(more)
    total = 0.0
    for p in tree:
      try:
        fields = _stat(p)
      except OSError:
        continue
      total += (int(fields[11]) + int(fields[12])) / tick
    out[name] = total
  return out


def measured(c, root: str, model: str, tag: str, pids: dict) -> dict:
  """`workload`'s tokens and the CPU seconds each process spent on it."""
  before = cpu_seconds(pids)
  tokens = workload(c, root, model, tag)
  after = cpu_seconds(pids)
  return {"tokens": tokens, "cpu_s": {n: after[n] - before[n] for n in pids}}


OPENINGS = [f"{a} {b}" for a in ("amber", "birch", "cedar", "delta", "ember", "fjord",
                                  "garnet", "harbor", "indigo", "juniper", "krypton", "lagoon")
            for b in ("owl", "pike", "quail", "raven", "salmon", "tern", "urchin", "vole")]


def workload(c, root: str, model: str, tag: str) -> int:
  """The conversations against `root`; returns the tokens generated."""
  # Each conversation its own opening words (distinct users), new ones every round.
  openings = random.Random(tag).sample(OPENINGS, c.conversations)

  def conversation(i: int) -> int:
    prompt, generated = f"# {openings[i]}: a queue class\n", 0
    for turn in range(c.turns):
      answer = client.post(root + "/v1/completions", timeout=300, json={
          "model": model, "prompt": prompt, "max_tokens": c.max_tokens, "temperature": 0})
      answer.raise_for_status()
      body = answer.json()
      generated += body["usage"]["completion_tokens"]
      prompt += body["choices"][0]["text"] + f"\n# turn {turn}\n"
    return generated
  # One client, its connections kept: a new one per request costs the client ~a core here.
  with httpx.Client(limits=httpx.Limits(max_connections=c.conversations)) as client, \
      concurrent.futures.ThreadPoolExecutor(c.conversations) as pool:
    return sum(pool.map(conversation, range(c.conversations)))


def plot(results: dict, path: str) -> None:
  with common.figure(path, figsize=(7, 3.8)) as (_, ax):
    names = list(results["tokens_per_s"])
    ax.bar([n.replace(": ", ":\n") for n in names], [results["tokens_per_s"][n] for n in names],
           color=["tab:blue", "tab:orange"] * (len(names) // 2))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel("generated tokens / s (median)")
    ax.set_title(f"multi-turn throughput, {results['cores']} cores, "
                 f"load {results['load_before'][0]:.1f}")


# Where the workers run: all of them on every core, or each on its own core (one device
# group per worker, as on a host with a device per worker).
PLACEMENTS = {"shared cores": (None, None), "a core each": ((0,), (1,))}


def run(c) -> dict:
  results = {"device": common.device_label(), "cores": os.cpu_count(),
             "load_before": os.getloadavg(), "config": c.to_dict()}
  rounds = itertools.count()
  placements = {name: cpus for name, cpus in PLACEMENTS.items()
                if name == "shared cores" or os.cpu_count() >= 2}
  with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
    args = [*c.serve_args, "--compile-cache", os.path.join(tmp, "xla")]
    runs = {}
    for placement, cpus in placements.items():
      workers = [stack.enter_context(ServeProcess(args, cpus=cores)) for cores in cpus]
      gateway = Gateway(workers, os.path.join(tmp, f"smg {placement}.log"),
                        policy="cache_aware", timeout_s=120)
      stack.callback(gateway.stop)
      pids = {"client": os.getpid(), "smg": gateway.proc.pid,
              **{f"worker {i}": w.proc.pid for i, w in enumerate(workers)}}
      model, direct = workers[0].model, workers[0].root
      runs[f"{placement}: 1 worker direct"] = (
          lambda root=direct, model=model, pids=pids: measured(c, root, model, next(rounds),
                                                               pids))
      runs[f"{placement}: smg cache_aware, 2 workers"] = (
          lambda root=gateway.root, model=model, pids=pids: measured(c, root, model,
                                                                     next(rounds), pids))
    timings = common.interleaved(runs, c.repeats)
  results["load_after"] = os.getloadavg()
  results["seconds"] = timings.seconds
  results["tokens"] = {name: [r["tokens"] for r in rs] for name, rs in timings.results.items()}
  results["tokens_per_s"] = {name: common.median([t / s for t, s in zip(
      results["tokens"][name], timings.seconds[name])]) for name in runs}
  # Cores kept busy: each process's CPU seconds / the wall seconds of the round (median);
  # their sum near the core count says the cores bound the throughput.
  results["cores_busy"] = {name: {proc: common.median([
      r["cpu_s"][proc] / s for r, s in zip(timings.results[name], timings.seconds[name])])
      for proc in timings.results[name][0]["cpu_s"]} for name in runs}
  def busy(name: str) -> str:  # "1.9 (client 0.3, smg 0.2, worker 0 0.7, worker 1 0.7)"
    parts = results["cores_busy"][name]
    return (f"{sum(parts.values()):.1f} (" +
            ", ".join(f"{proc} {v:.2f}" for proc, v in parts.items()) + ")")

  results["ratio"], results["table"] = {}, []
  for placement in placements:
    direct = results["tokens_per_s"][f"{placement}: 1 worker direct"]
    gated = results["tokens_per_s"][f"{placement}: smg cache_aware, 2 workers"]
    results["ratio"][placement] = gated / direct
    results["table"].append({
        "claim": "#32", "what": f"multi-turn throughput ({c.conversations} conversations x "
                                f"{c.turns} turns), smg cache_aware over 2 workers / 1 worker, "
                                f"{placement}",
        "seed": f"goal >= {c.goal_ratio}x",
        "ours": f"{gated / direct:.2f}x ({gated:.1f} vs {direct:.1f} tok/s; cores busy "
                f"{busy(f'{placement}: smg cache_aware, 2 workers')} vs "
                f"{busy(f'{placement}: 1 worker direct')}; {results['cores']} cores, load "
                f"{results['load_before'][0]:.1f}->{results['load_after'][0]:.1f})"})
  print(f"gateway_bench on {results['device']}")
  common.print_claims(results["table"], "{claim:<5} {what:<110} {seed:<14} {ours}")
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
