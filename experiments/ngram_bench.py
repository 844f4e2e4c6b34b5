"""n-gram (prompt lookup) speculation on SmolLM2-135M-Instruct (issue 27 item 3).

Warm Engines on the real model (float32 weights), greedy, chat prompts rendered
by the model's own chat template:
  plain        speculative=None,
  ngram_k      speculative="ngram", num_draft=K (configs: 4), ngram_n 3,
  ngram_auto   speculative="ngram", num_draft="auto" (kvjax/engine/sched/draft_policy.py),
at batch 1 and 4 (max_num_seqs = batch), on two workloads:
  repeat   "Repeat the following text exactly: <paragraph>" (the answer copies
           the prompt: prompt lookup should pay),
  story    an open-ended story (little to copy: it should not).
Every variant's tokens must equal plain's (greedy speculation is exact).  Each
(workload, batch) runs every variant twice untimed (compiles; the auto policy
starts measuring; the second call meets the prefix-cache hits), then `repeats`
interleaved rounds (common.interleaved); the median output tokens/s and its
ratio to plain are reported beside the issue's goals (>= 1.3x where it should pay, auto >= 0.97x everywhere).  Prints the goal
and ours; writes results/<name>.json and .png; says which CPU ran it.
"""
import functools
import os
import time

from absl import app, logging
from ml_collections import config_flags
import numpy as np

import kvjax
from experiments import common

PARAGRAPHS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed "
    "the wick, polished the great lens, and wrote the weather in a leather logbook. Ships "
    "passed far out at sea, and none of their crews ever knew his name.",
    "To install the package, open a terminal and run the install command. Then create a "
    "configuration file in your home directory, set the cache path and the number of "
    "worker threads, and restart the service so that it reads the new settings.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes "
    "place in the chloroplasts of plant cells, where chlorophyll absorbs red and blue "
    "light and reflects green light, which is why most leaves look green to us.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, members agreed to raise funding for the library, delay the new parking "
    "lot, and publish the final report on the town website before the end of March.",
)
STORIES = ("a fox who learns to sail", "a robot that paints the night sky",
           "two friends lost in a desert city", "a girl who can talk to rivers")


def chat_prompts(model, workload: str) -> list[list[int]]:
  """The workload's four chat prompts, as token ids through the model's template."""
  if workload == "repeat":
    texts = [f"Repeat the following text exactly:\n\n{p}" for p in PARAGRAPHS]
  elif workload == "story":
    texts = [f"Write a short story about {s}." for s in STORIES]
  else:
    raise ValueError(f"unknown workload {workload!r}; use 'repeat' or 'story'")
  tok = model.tokenizer
  return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
          for t in texts]


def variants(c) -> dict:
  """name -> EngineConfig options."""
  return {"plain": dict(speculative=None),
          f"ngram_k{c.num_draft}": dict(speculative="ngram", num_draft=c.num_draft,
                                        ngram_n=c.ngram_n),
          "ngram_auto": dict(speculative="ngram", num_draft="auto", ngram_n=c.ngram_n)}


def _generate(engine, prompts, max_new: int):
  return engine.generate(prompts, max_new)


def section(model, c, workload: str, batch: int, engines: dict) -> dict:
  prompts = chat_prompts(model, workload)[:batch]
  runs = {name: functools.partial(_generate, engine, prompts, c.max_new_tokens)
          for name, engine in engines.items()}
  start = time.perf_counter()
  # Two untimed calls: the second meets the prefix-cache hit shapes (and compiles them).
  timings = common.interleaved(runs, c.repeats, warmup=2)
  medians = timings.medians()
  out = {"prompt_tokens": [len(p) for p in prompts], "seconds": timings.seconds,
         "first_seconds": timings.first_seconds, "tokens_per_s": {}, "ratio_to_plain": {},
         "acceptance_length": {}, "same_tokens_as_plain": {}}
  plain_tokens = timings.results["plain"][-1].tokens
  for name, result in timings.results.items():
    tokens = sum(len(t) for t in result[-1].tokens)
    out["tokens_per_s"][name] = tokens / medians[name]
    out["acceptance_length"][name] = result[-1].stats.get("acceptance_length")
    out["same_tokens_as_plain"][name] = all(r.tokens == plain_tokens for r in result)
  for name in runs:
    out["ratio_to_plain"][name] = out["tokens_per_s"][name] / out["tokens_per_s"]["plain"]
  chosen = engines["ngram_auto"].steps.num_draft
  out["auto_steps_k"] = {str(k): int(np.sum(np.asarray(chosen) == k)) for k in set(chosen)}
  out["wall_s"] = time.perf_counter() - start
  out["loadavg_end"] = os.getloadavg()
  logging.info("%s batch %d: %s", workload, batch, out["ratio_to_plain"])
  return out


def _table(results, c) -> list:
  rows = []
  k_name = f"ngram_k{c.num_draft}"
  for key, r in results["runs"].items():
    workload, batch = key.split("_b")
    ratios = r["ratio_to_plain"]
    if workload == "repeat":
      rows.append(("issue27", f"ngram K={c.num_draft} / plain tok/s, {workload}, batch {batch}",
                   f">= {c.goal_pays}x", round(ratios[k_name], 3)))
    rows.append(("issue27", f"ngram auto / plain tok/s, {workload}, batch {batch}",
                 f">= {c.goal_auto}x" if workload != "repeat" else
                 f">= {c.goal_auto}x (>= {c.goal_pays}x)", round(ratios["ngram_auto"], 3)))
  return common.claim_rows(rows)


def _plot(results, path):
  keys = list(results["runs"])
  names = list(results["runs"][keys[0]]["tokens_per_s"])
  with common.figure(path, 1, 1, figsize=(max(6, 2.2 * len(keys)), 4)) as (_, ax):
    x = np.arange(len(keys))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
      values = [results["runs"][k]["tokens_per_s"][name] for k in keys]
      bars = ax.bar(x + (i - (len(names) - 1) / 2) * width, values, width, label=name)
      for bar, k in zip(bars, keys):
        ax.annotate(f"{results['runs'][k]['ratio_to_plain'][name]:.2f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(x, [k.replace("_b", "\nbatch ") for k in keys])
    ax.set(ylabel="output tokens/s (median)",
           title=f"{results['checkpoint']} greedy, {results['device']}")
    ax.legend(fontsize=8)


def run(c) -> dict:
  device = common.describe_device()
  model = kvjax.load_checkpoint(c.checkpoint)
  results = {"device": common.device_label(device), "machine": device["os"],
             "jax": device["jax"], "checkpoint": c.checkpoint, "config": c.to_dict(),
             "loadavg_start": os.getloadavg(), "runs": {}}
  for batch in c.batches:
    engines = {name: kvjax.Engine(model, max_num_seqs=batch, max_model_len=c.max_model_len,
                                  **options) for name, options in variants(c).items()}
    for workload in c.workloads:
      results["runs"][f"{workload}_b{batch}"] = section(model, c, workload, batch, engines)
  results["table"] = _table(results, c)
  print(f"ngram_bench on {results['device']}, loadavg {os.getloadavg()}")
  common.print_claims(results["table"], "{claim:<8} {what:<52} {seed:<24} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))
  return results


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/ngram_bench.py", "experiment config", lock_config=True)
  app.run(main)
