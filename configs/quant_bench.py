# python -m experiments.quant_bench --config=configs/quant_bench.py
"""KV-cache and weight-only quantization on the default model (claims C6, C12).

get_config("runlocal"): a CPU smoke run (few short windows, 32 greedy tokens);
get_config("cpu_speed"): decode speed only, of a ~150M random Llama-shaped model
whose weights do not fit the CPU caches;
get_config("gpu"): decode speed only, of a ~1B random Llama-shaped model on the
GPU, where weight bytes rather than launch overhead set the step time.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.model = ""  # "" = the built-in default model; else a preset or checkpoint dir
  config.sections = ("kv", "weights", "speed")
  # The default model's corpus (kvjax/training/code_corpus.py; experiments/build_corpus.py
  # makes the pack): held-out packages to score, training split to calibrate AWQ.
  config.corpus_manifest = "kvjax/assets/code_corpus_manifest.json"
  config.corpus_pack = "~/.cache/kvjax/corpus/code_corpus.zip"
  config.seq_len = 512  # held-out windows of seq_len + 1 tokens
  config.heldout_windows = 64
  config.batch_size = 16
  config.page_size = 16
  config.kv_dtypes = ("fp32", "bf16", "int8", "int4")
  config.greedy_prompts = 4
  config.greedy_prompt_len = 64
  config.greedy_new_tokens = 256
  config.weight_schemes = ("int8", "int4-g32", "int4-g64", "int4-g128")
  config.awq_schemes = ("int4-g32", "int4-g128")
  config.calibration_windows = 8  # training-split windows of seq_len + 1 for AWQ
  # Decode speed (batch 1, bf16 activations, schemes above): the model above unless
  # speed_preset holds ModelConfig fields (random weights).
  config.speed_preset = ml_collections.ConfigDict()
  config.speed_new_tokens = 256
  config.speed_repeats = 5
  config.out_dir = "results"
  config.name = "quant_bench"
  if arg == "runlocal":
    config.seq_len = 128
    config.heldout_windows = 4
    config.greedy_prompts = 1
    config.greedy_new_tokens = 32
    config.weight_schemes = ("int8", "int4-g128")
    config.awq_schemes = ("int4-g128",)
    config.calibration_windows = 2
    config.speed_new_tokens = 16
    config.speed_repeats = 1
    config.name = "quant_bench_runlocal"  # never overwrite the committed results
  if arg == "cpu_speed":  # speed only, a ~150M model whose weights overflow the CPU caches
    config.sections = ("speed",)
    config.weight_schemes = ("int8", "int4-g128")
    config.speed_new_tokens = 32
    config.speed_repeats = 2
    config.speed_preset = ml_collections.ConfigDict(dict(
        name="llama-150m-like", vocab_size=32000, hidden_size=1024, intermediate_size=4096,
        num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
        max_position_embeddings=4096))
    config.name = "quant_bench_cpu_speed"
  if arg == "gpu":  # speed only: the device has no corpus pack
    config.sections = ("speed",)
    config.weight_schemes = ("int8", "int4-g32", "int4-g128")
    config.speed_new_tokens = 128
    config.speed_repeats = 2
    config.speed_preset = ml_collections.ConfigDict(dict(
        name="llama-1b-like", vocab_size=32000, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        max_position_embeddings=4096))
    config.name = "quant_bench_gpu"
  return config
