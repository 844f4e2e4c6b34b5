# python -m experiments.structured_bench --config=configs/structured_bench.py
"""Structured-output decode throughput and speculation under a JSON schema (issue 31).

`num_requests` concurrent requests (max_num_seqs = num_requests) through warm
Engines, each producing exactly `max_new_tokens` tokens (the schema cannot finish
sooner; unconstrained rows ignore EOS): unconstrained vs every request under one
JSON schema, with multi-step bursts as the engine's default (`scheduler_steps`)
and with them off (what a constrained engine runs today), then n-gram speculation
with and without the schema (acceptance).  `get_config("runlocal")` shrinks it to
a smoke run.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # "": the built-in byte model; or e.g. smollm2-135m-instruct
  config.num_requests = 32
  config.max_new_tokens = 128
  config.max_model_len = 256
  config.scheduler_steps = 16  # the engine default multi-step burst length
  config.num_draft = 4  # n-gram K
  config.ngram_n = 3
  config.repeats = 3  # interleaved timed rounds after two untimed (compiling) ones
  config.goal_throughput = 0.9  # constrained tok/s >= 0.9x unconstrained at 32 requests
  config.out_dir = "results"
  config.name = "structured_bench"
  if arg == "runlocal":
    config.num_requests = 4
    config.max_new_tokens = 24
    config.repeats = 1
    config.name = "structured_bench_runlocal"
  return config
