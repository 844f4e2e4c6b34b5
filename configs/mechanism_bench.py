# python -m experiments.mechanism_bench --config=configs/mechanism_bench.py
"""Mechanism claims (C1, C2, C3, C7, C11, C13, C17) on the default model and the CPU.

`sections` picks which parts run, e.g. --config.sections="('c2','c7')".
`get_config("runlocal")` shrinks every timed part to a smoke run and writes
results/mechanism_bench_runlocal.*, never the committed results.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = ""  # "" = the built-in default model (tiny-code)
  config.seed = 0
  config.page_size = 16
  config.repeats = 3  # median of interleaved timed runs per variant
  config.sections = ("c1", "c2", "c3", "c7", "c11", "c13", "c17")
  # C1: one prompt through prefill + greedy decode, against a full forward.
  config.c1_prompt_len = 37
  config.c1_new_tokens = 12
  config.c1_num_prompts = 4
  # C2: the seed's pairs view at n = 14; generate timed without and with a cache.
  # Both paths pad the sequence to a power of two, so prompt + n fills one exactly.
  config.c2_pairs_n = 14
  config.c2_prompt_len = 8
  config.c2_new_tokens = (24, 56, 120, 248)
  # C3: preset arithmetic; the default model timed at batch 1.
  config.c3_presets = ("llama2-7b", "llama3-8b")
  config.c3_contexts = (1024, 8192, 131072)
  config.c3_preset_prefill_len = 4096
  # H200: 989 TFLOP/s dense bf16 / 4.8 TB/s; FLOP/byte above which a step is compute bound.
  config.c3_ridge_flops_per_byte = 206
  config.c3_prompt_len = 256
  config.c3_new_tokens = 256
  # C7: lognormal request lengths over a pool of 16 max-length requests.
  config.c7_num_requests = 300
  config.c7_prompt_median = 512
  config.c7_output_median = 256
  config.c7_sigma = 0.8
  config.c7_max_model_len = 2048
  config.c7_pool_tokens = 32768
  config.c7_max_num_batched_tokens = 2048
  # C11: the seed's pool (Qwen3.5 hybrid with one MTP module, MAX_NUM_SEQS=1).
  config.c11_seed_preset = "qwen3.5-9b"
  config.c11_seed_pool_tokens = 188847
  config.c11_seed_pool_on = 73728
  config.c11_seed_max_num_seqs = 1
  config.c11_num_draft = 2
  config.c11_engine_pages = 64
  config.c11_budget_mib = 64
  # C13: batch 1 decode, three ways of dispatching the same step.
  config.c13_prompt_len = 32
  config.c13_new_tokens = 64
  config.c13_eager_tokens = 6
  # C17: independent short prompts, growing outputs.
  config.c17_batch = 8
  config.c17_prompt_lens = (16, 128)
  config.c17_new_tokens = (1, 2, 4, 8, 16, 32, 64)
  config.out_dir = "results"
  config.name = "mechanism_bench"
  if arg == "runlocal":
    config.repeats = 1
    config.c1_new_tokens = 4
    config.c2_new_tokens = (8, 24)
    config.c3_prompt_len = 64
    config.c3_new_tokens = 8
    config.c7_num_requests = 40
    config.c13_new_tokens = 8
    config.c13_eager_tokens = 3
    config.c17_prompt_lens = (16,)
    config.c17_new_tokens = (1, 4)
    config.name = "mechanism_bench_runlocal"
  return config
