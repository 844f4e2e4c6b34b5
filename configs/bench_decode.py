# python -m experiments.bench_decode --config=configs/bench_decode.py
"""Decode throughput: kvjax vs HF transformers `generate` on one random model.

The model (4 layers, hidden 256, GQA 8/2) is built with transformers, saved with
`save_pretrained` and loaded into kvjax, so both sides run identical weights.
`get_config("runlocal")` shrinks lengths and repeats for a smoke run.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.num_layers = 4
  config.hidden_size = 256
  config.intermediate_size = 688
  config.num_heads = 8
  config.num_kv_heads = 2
  config.vocab_size = 4096
  config.prompt_len = 128
  config.new_tokens = 128
  config.batch_sizes = (1, 8)
  config.repeats = 5
  config.page_size = 16
  config.include_no_cache = True  # kvjax's quadratic recompute baseline (claims C2, C17)
  config.no_cache_repeats = 3
  config.out_dir = "results"
  config.name = "bench_decode"
  config.seed = 0
  if arg == "runlocal":
    config.prompt_len = 16
    config.new_tokens = 8
    config.repeats = 2
    config.no_cache_repeats = 1
    config.name = "bench_decode_runlocal"  # never overwrite the committed results
  return config
