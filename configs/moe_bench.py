# python -m experiments.moe_bench --config=configs/moe_bench.py
"""Mixture of experts (issue 30) on the CPU: a batch-1 decode step of a small random
MoE vs a dense model with the same active parameters, bytes per step from the HLO,
the switched vs grouped expert paths of one layer.
`get_config("beyond_cache")` widens both models past the CPU's last-level cache (at the
default size the dense twin's 16.8 MB stays in a 32 MiB L3 while the MoE's 105 MB cannot,
so the ratio there measures cache residency, not the MoE).
`get_config("runlocal")` shrinks it to a smoke run and writes
results/moe_bench_runlocal.*, never the committed results; `get_config("gpu")` is
experiments/run_moe_device.sh's (prefill-sized grouped matmuls, tokamax's kernels).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.repeats = 9  # median of interleaved timed runs per variant (a shared 2-core VM: noisy)
  # The MoE: top-2 of 16 experts of width 512 in every layer; its dense twin has
  # intermediate_size = 2 x 512, so the same active parameters (+ the router).
  config.vocab_size = 512
  config.hidden_size = 256
  config.num_layers = 4
  config.num_heads = 4
  config.num_kv_heads = 2
  config.head_dim = 64
  config.num_experts = 16
  config.num_experts_per_tok = 2
  config.moe_intermediate_size = 512
  config.prompt_len = 16
  config.new_tokens = 32  # decode steps per timed generate (tpot = their mean)
  config.page_size = 16
  config.grouped_tokens = 64  # a prefill chunk's tokens for the grouped-matmul records
  config.goal_ratio = 1.3  # MoE tpot / dense tpot at batch 1 (issue 30's goal)
  config.out_dir = "results"
  config.name = "moe_bench"
  if arg == "beyond_cache":  # both models past the L3 (33.6 MB here): DRAM against DRAM
    config.hidden_size = 512  # the dense twin's 65 MB no longer sits in the cache
    config.head_dim = 128
    config.moe_intermediate_size = 1024
    config.name = "moe_bench_beyond_cache"
  if arg == "runlocal":
    config.repeats = 1
    config.num_layers = 2
    config.new_tokens = 8
    config.name = "moe_bench_runlocal"
  if arg == "gpu":
    config.grouped_tokens = 4096
    config.name = "moe_bench_gpu"
  return config
