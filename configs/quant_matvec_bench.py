# python -m experiments.quant_matvec_bench --config=configs/quant_matvec_bench.py
"""Quantized-weight matmul variants at SmolLM2-135M's shapes on XLA:CPU (issue 27 item 4).

get_config("int8_batch1"): only float32 and qmatmul-int8 (per channel) at batch 1 with
decode options, seven rounds (issue 52: the tied head's int8 kernel) into
results/quant_matvec_bench_int8_batch1.*.
get_config("runlocal"): small shapes, two rounds (a smoke test of the launcher; its
numbers mean nothing, the weights fit the caches) into results/quant_matvec_bench_runlocal.*.
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.shapes = ((576, 1536), (1536, 576), (576, 49152))  # [D, F]: w_up, w_down, the head
  config.batches = (1, 8, 32)  # 32: the most rows layers.dense gives qmatmul (MAX_ROWS)
  # Each timed program runs distinct copies of its weight until the float32 copies
  # fill this many bytes, so every variant reads its weights from DRAM, not the caches
  # (a decode step reads 538 MB of float32 weights; the host's L3 is 32 MiB).
  config.cold_bytes = 256_000_000
  config.option_sets = ("decode", "prefill")  # kvjax/runtime/xla_options.py's compiler options
  config.repeats = 5  # interleaved rounds after one untimed call each
  config.variants = ()  # the variants to run (experiment's _variants names); () all
  config.out_dir = "results"
  config.name = "quant_matvec_bench"
  if arg == "int8_batch1":
    config.batches = (1,)
    config.option_sets = ("decode",)
    config.variants = ("float32", "qmatmul-int8")
    config.repeats = 7
    config.name = "quant_matvec_bench_int8_batch1"
  if arg == "runlocal":
    config.shapes = ((64, 96),)
    config.cold_bytes = 0
    config.repeats = 2
    config.name = "quant_matvec_bench_runlocal"  # never overwrite the committed results
  return config
