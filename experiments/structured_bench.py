"""Structured outputs at load: decode throughput and speculation under a JSON schema (issue 31).

Every request of a round runs at once (max_num_seqs = num_requests) and produces
exactly max_new_tokens tokens: the schema (an array of at least 60 person records)
cannot finish sooner, and unconstrained requests ignore EOS.  Arms, each a warm
Engine on the same prompts (a chat asking for the records, one per request):
  plain          unconstrained, multi-step bursts (num_scheduler_steps, the default),
  plain_steps1   unconstrained, one decode step per device call,
  schema         every request under the schema (the engine runs no bursts while a
                 constrained request runs, and fills masks on the host each step),
  ngram          n-gram speculation (K = num_draft), unconstrained,
  ngram_schema   n-gram speculation under the schema (drafts masked per position; where
                 the grammar forces the next tokens, those are the drafts).
Rounds interleave the arms (common.interleaved); median output tokens/s.  Reports
schema / plain against the issue's goal (>= 0.9x at 32 requests), schema /
plain_steps1 (the mask's own cost, bursts aside), the host mask time per token,
every constrained output validated with jsonschema, and the n-gram acceptance
length with and without the schema (goal: with >= without).  Prints the goal and
ours; writes results/<name>.json and .png; says which device ran it.
"""
import functools
import json
import os
import time

from absl import app, logging
import jsonschema
from ml_collections import config_flags

import kvjax
from experiments import common
from kvjax.constraints import Constraint
from kvjax.constraints.vocabulary import constraint_book

SCHEMA = {"type": "array", "minItems": 60, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]}}}}


def arms(c) -> dict:
  """name -> (EngineConfig options, constrained?)."""
  ngram = dict(speculative="ngram", num_draft=c.num_draft, ngram_n=c.ngram_n)
  return {"plain": (dict(num_scheduler_steps=c.scheduler_steps), False),
          "plain_steps1": (dict(num_scheduler_steps=1), False),
          "schema": (dict(num_scheduler_steps=c.scheduler_steps), True),
          "ngram": (ngram, False),
          "ngram_schema": (ngram, True)}


def prompts(model, n: int) -> list[list[int]]:
  tok = model.tokenizer
  return [tok.encode(tok.apply_chat_template([{"role": "user", "content": (
      f"List 60 people (batch {i}) as a JSON array of objects with name, age and role.")}]),
      add_special_tokens=False) for i in range(n)]


def run_round(name: str, engine, ids, max_new: int, constrained: bool) -> dict:
  """Every prompt to completion -> output ids per request and acceptance counts."""
  start = time.perf_counter()
  options = dict(constraint=Constraint("json_schema", SCHEMA)) if constrained else dict(
      ignore_eos=True)
  request_ids = [engine.add_request(p, max_new, **options) for p in ids]
  outputs, emitted, verify_steps = {}, 0, 0
  while engine.has_unfinished:
    for out in engine.step():
      if out.finished:
        outputs[out.request_id] = out.output_ids
        emitted += out.metrics.emitted
        verify_steps += out.metrics.verify_steps
  logging.info("%s: %d x %d tokens in %.1f s", name, len(ids), max_new,
               time.perf_counter() - start)  # progress, compiles included
  return {"tokens": [outputs[r] for r in request_ids],
          "acceptance_length": emitted / verify_steps if verify_steps else None}


def valid_prefix(tokenizer, tokens) -> bool:
  """Is the (length-cut) output a prefix of a document the schema accepts?  Checked by
  completing it: every record it finished validates, and the text is JSON up to a cut."""
  text = tokenizer.decode(tokens)
  records = text[1:].split("},")  # "[{...},{...},{..." -> finished records + a partial one
  finished = [r + "}" for r in records[:-1]]
  item = SCHEMA["items"]
  return text.startswith("[") and all(
      jsonschema.Draft202012Validator(item).is_valid(json.loads(r)) for r in finished)


def run(c) -> dict:
  device = common.describe_device()
  model = kvjax.load_checkpoint(c.checkpoint or None)
  ids = prompts(model, c.num_requests)
  engines = {}
  for name, (options, constrained) in arms(c).items():
    engine = kvjax.Engine(model, max_num_seqs=c.num_requests, max_model_len=c.max_model_len,
                          **options)
    engine.constraints = constraint_book(model.tokenizer, model.config)
    engines[name] = (engine, constrained)
  runs = {name: functools.partial(run_round, name, engine, ids, c.max_new_tokens, constrained)
          for name, (engine, constrained) in engines.items()}
  logging.info("structured_bench: %d arms x (2 untimed + %d timed) rounds of %d requests",
               len(runs), c.repeats, c.num_requests)
  # Two untimed rounds: the second meets the prefix-cache hit shapes (and compiles them).
  timings = common.interleaved(runs, c.repeats, warmup=2)
  medians = timings.medians()
  results = {"device": common.device_label(device), "machine": device["os"],
             "jax": device["jax"], "checkpoint": c.checkpoint or "built-in byte model",
             "config": c.to_dict(), "schema": SCHEMA, "loadavg": os.getloadavg(),
             "seconds": timings.seconds, "tokens_per_s": {}, "acceptance_length": {}}
  for name, samples in timings.results.items():
    last = samples[-1]
    assert all(len(t) == c.max_new_tokens for t in last["tokens"]), name
    results["tokens_per_s"][name] = c.num_requests * c.max_new_tokens / medians[name]
    results["acceptance_length"][name] = last["acceptance_length"]
    if engines[name][1]:
      results[f"{name}_all_valid"] = all(valid_prefix(model.tokenizer, t)
                                         for s in samples for t in s["tokens"])
  tps = results["tokens_per_s"]
  results["ratio_schema_to_plain"] = tps["schema"] / tps["plain"]
  results["ratio_schema_to_plain_steps1"] = tps["schema"] / tps["plain_steps1"]
  results["mask_us_per_token"] = engines["schema"][0].constraints.mask_us_per_token
  results["table"] = common.claim_rows([
      ("issue31", f"schema / plain tok/s, {c.num_requests} requests",
       f">= {c.goal_throughput}x", round(results["ratio_schema_to_plain"], 3)),
      ("issue31", "schema / plain tok/s, both one step per call", "(bursts aside)",
       round(results["ratio_schema_to_plain_steps1"], 3)),
      ("issue31", "host mask time per token (us)", "~50 (llguidance)",
       round(results["mask_us_per_token"], 1)),
      ("issue31", "n-gram acceptance length, schema vs none", "schema >= none",
       f"{results['acceptance_length']['ngram_schema']:.2f} vs "
       f"{results['acceptance_length']['ngram']:.2f}"),
      ("issue31", "every constrained output valid", "100%",
       results["schema_all_valid"] and results["ngram_schema_all_valid"])])
  print(f"structured_bench on {results['device']}, loadavg {os.getloadavg()}")
  common.print_claims(results["table"], "{claim:<8} {what:<48} {seed:<18} {ours}")
  common.write_results(c.out_dir, c.name, results, plot=functools.partial(_plot, results))
  return results


def _plot(results, path):
  names = list(results["tokens_per_s"])
  values = [results["tokens_per_s"][n] for n in names]
  with common.figure(path, 1, 1, figsize=(7, 4)) as (_, ax):
    bars = ax.bar(names, values, color=["C0", "C0", "C1", "C2", "C3"])
    for bar, name in zip(bars, names):
      accept = results["acceptance_length"][name]
      label = f"{bar.get_height():.0f}" + (f"\naccept {accept:.2f}" if accept else "")
      ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                  va="bottom", fontsize=7)
    ax.set(ylabel="output tokens/s (median)",
           title=f"{results['checkpoint']}, {results['config']['num_requests']} requests, "
                 f"{results['device']}")


def main(argv):
  del argv
  run(_CONFIG.value)


if __name__ == "__main__":
  # Defined here, not at import: absl allows one --config per process.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/structured_bench.py", "experiment config", lock_config=True)
  app.run(main)
