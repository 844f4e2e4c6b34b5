# python -m experiments.memory_ledger --config=configs/memory_ledger.py
"""Memory ledger experiment (claims C4-C6): seed figures beside kvjax's ledger.

`get_config("runlocal")` shrinks the plot's context sweep; the table is always
complete (it is arithmetic and takes milliseconds).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  # The seeds' card budget (C5), in GiB: the seeds' "GB" read as GiB.
  config.gpu_gib = 80.0
  config.reserve_gib = 4.0
  config.seed_weight_gib = 16.0  # "8B model, fp16 weights 16 GB", as stated.
  # Plot: KV GiB of one request vs context, with the int4 weights of the 70B.
  config.plot_presets = ("llama2-7b", "llama3-8b", "llama3-70b", "deepseek-v2",
                         "qwen3.5-9b")
  config.plot_log2_contexts = tuple(range(10, 18))  # 1K .. 128K tokens.
  config.out_dir = "results"
  config.name = "memory_ledger"
  if arg == "runlocal":
    config.plot_log2_contexts = (12, 15, 17)
    config.name = "memory_ledger_runlocal"  # never overwrite the committed results.
  return config
