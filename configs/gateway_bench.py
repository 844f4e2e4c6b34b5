# python -m experiments.gateway_bench --config=configs/gateway_bench.py
"""Issue 32: throughput of a multi-turn workload through smg cache_aware over 2 kvjax
serve workers vs 1 worker asked directly (goal >= 1.8x).
`get_config("runlocal")` shrinks it to a smoke run and writes
results/gateway_bench_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.repeats = 3  # interleaved rounds per setup (median)
  config.conversations = 8  # run concurrently, each one turn after the other
  config.turns = 3
  config.max_tokens = 16  # per turn
  # Worker settings (the built-in byte-level model: smg forwards text prompts only).
  config.serve_args = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                       "--max-model-len", "256", "--page-size", "16", "--warm-up", "minimal")
  config.goal_ratio = 1.8
  config.out_dir = "results"
  config.name = "gateway_bench"
  if arg == "runlocal":
    config.repeats = 1
    config.conversations = 4
    config.turns = 2
    config.max_tokens = 8
    config.name = "gateway_bench_runlocal"
  return config
