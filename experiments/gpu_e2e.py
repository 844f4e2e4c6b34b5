"""End-to-end device check: the default model generating through the compiled
Pallas attention kernel, against the jnp reference backend, plus MTP speculation
(and its speedup at batch 1, issue #5's goal >= 1.5x).

  python -m experiments.gpu_e2e --config=configs/gpu_e2e.py

Greedy tokens must agree (float32); tokens/s are medians of `repeats` runs after
a warm-up.  Writes <out_dir>/<name>.json.
"""
from __future__ import annotations

import json

from absl import app
from ml_collections import config_flags
import jax

from experiments import common

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gpu_e2e.py", "experiment config", lock_config=True)

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
           "import os\n\ndef walk(path):\n", "for i in range(10):\n",
           "def parse_args(argv):\n    parser = ", "try:\n    import json\nexcept",
           "    def __repr__(self):\n        return ", "if __name__ == '__main__':\n"]


def _timed(fn, repeats):
  """(the last run's result, median seconds of `repeats` runs after one warm-up)."""
  timed = common.interleaved({"run": fn}, repeats)
  return timed.results["run"][-1], common.median(timed.seconds["run"])


def main(argv):
  del argv
  cfg = _CONFIG.value
  if not 1 <= cfg.num_prompts <= len(PROMPTS):
    raise ValueError(f"num_prompts must be in [1, {len(PROMPTS)}], got {cfg.num_prompts}")
  import kvjax

  model = kvjax.load_checkpoint()
  tok = kvjax.ByteTokenizer()
  prompts = [[tok.bos_id] + tok.encode(p) for p in PROMPTS[:cfg.num_prompts]]
  pallas = cfg.pallas_backend
  report = {"device": common.device_label(), "jax": jax.__version__, "runs": {}}
  outputs = {}
  for name, kwargs in [("reference", dict(backend="reference")),
                       ("pallas", dict(backend=pallas)),
                       ("pallas+mtp", dict(backend=pallas, speculative="mtp", num_draft=2)),
                       ("reference+mtp", dict(backend="reference", speculative="mtp",
                                              num_draft=2))]:
    result, seconds = _timed(
        lambda: kvjax.generate(model, prompts, cfg.new_tokens, **kwargs), cfg.repeats)
    outputs[name] = result.tokens
    report["runs"][name] = dict(median_s=seconds,
                                tokens_per_s=sum(map(len, result.tokens)) / seconds,
                                acceptance_length=result.stats.get("acceptance_length"))
    print(name, report["runs"][name], flush=True)
  # Issue goal: MTP speedup >= 1.5x at batch 1, where a decode step is bandwidth bound.
  for name, kwargs in [("pallas_batch1", dict(backend=pallas)),
                       ("pallas+mtp_batch1", dict(backend=pallas, speculative="mtp",
                                                  num_draft=2))]:
    result, seconds = _timed(
        lambda: kvjax.generate(model, prompts[:1], cfg.new_tokens, **kwargs), cfg.repeats)
    outputs[name] = result.tokens
    report["runs"][name] = dict(median_s=seconds, tokens_per_s=len(result.tokens[0]) / seconds,
                                acceptance_length=result.stats.get("acceptance_length"))
    print(name, report["runs"][name], flush=True)
  report["mtp_speedup_batch1"] = (report["runs"]["pallas+mtp_batch1"]["tokens_per_s"]
                                  / report["runs"]["pallas_batch1"]["tokens_per_s"])
  report["pallas_equals_reference"] = outputs["pallas"] == outputs["reference"]
  report["mtp_equals_plain"] = outputs["pallas+mtp"] == outputs["reference"]
  report["mtp_equals_plain_batch1"] = outputs["pallas+mtp_batch1"] == outputs["pallas_batch1"]
  print(json.dumps(report, indent=1))
  common.write_results(cfg.out_dir, cfg.name, report)


if __name__ == "__main__":
  app.run(main)
